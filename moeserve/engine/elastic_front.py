"""The front end's side of elastic expert parallelism (--enable-elastic-ep, issue 37): the bookkeeping of a
re-formation, a mixin of DPEngineClient (engine/dp_client.py owns the socket, the ranks and the router; this
module only reads and changes them). engine/elastic.py has the lifecycle; the numbers below are its steps.

  _check_hung (1)        kill a rank the others wait for (the ProgressBoard)
  _start_recovery (3)    drop the lost ranks, take in replacements, send each rank its RankReform
  _poll_recovery (4, 5)  read the ready reports (and a ready survivor's early step reports), or kill laggards
  _finish_recovery (5)   keep what survivors kept (_adopt_kept), re-queue the rest
  _late_outputs (5)      a survivor's outputs of an older epoch, read after the loss
  _joiner_report, _replace, _spawn_spare (6)  --elastic-ep-replace
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import signal
import time

import msgspec

from moeserve.distributed.parallel_state import host_rendezvous
from moeserve.engine.elastic import BOARD_SLOTS, any_compiling, hung_ranks
from moeserve.engine.request import RequestStatus
from moeserve.protocol import EngineCoreOutput, RankCommand, RankReform, RankReport

logger = logging.getLogger("moeserve.engine.dp_client")  # the front end's log, as before the split

JOIN_GRACE_S = 10.0  # --elastic-ep-replace: a replacement that is up waits at most this long for another


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ElasticFront:
    """DPEngineClient's elastic EP methods. They use its state: sock, ranks, slots, router, requests, epoch,
    lost, joining, recovery, board (set up in DPEngineClient.__init__) and its _send, _recv, _route, _fail,
    _newly_dead, _take_report, _reset_ranks."""

    def _check_hung(self) -> None:
        """Kill a rank that holds its peers up: no rank has begun a collective for --elastic-ep-hang-timeout
        and this one's count lags the others' (they wait in a collective it never began). The caller then
        sees it dead and re-forms the others. A long step that makes progress begins collectives (each MoE
        layer has some), so it is not cut short; the timeout bounds one stretch of compute between two."""
        if self.board is None or self.recovery is not None:
            return
        now = time.monotonic()
        beats = {r: self.board.read(r) for r in self.slots}
        if beats != self._beats:
            self._beats, self._beats_at = beats, now
            return
        quiet = now - self._beats_at
        if quiet <= self.hang_timeout:
            return
        for r in hung_ranks(beats, self.epoch):
            if r in self.ranks.dead():
                continue
            logger.warning("rank %d began no collective for %.1f s while the other ranks waited on it "
                           "(--elastic-ep-hang-timeout %g): killing it", r, quiet, self.hang_timeout)
            self.ranks.kill_rank(r)
            self.hung_killed.append(r)
        self._beats = None

    def _joiner_report(self, report: RankReport) -> None:
        """--elastic-ep-replace: a replacement rank is up (it joins the next epoch), or failed before joining."""
        slot = report.dp_rank
        if slot in self._awaiting and not report.error:  # the spare of this re-formation: its place in it
            self._awaiting.discard(slot)
            dp = self.slots.index(slot)
            self._send(dp, RankCommand(reform=RankReform(self.epoch, dp, self.dp_size, self._epoch_init)))
            return
        if slot not in self.joining:
            return
        if report.error:
            logger.warning("replacement rank %d failed before joining: %s", slot, report.error)
            self.ranks.kill_rank(slot)
            self.lost.add(slot)
            del self.joining[slot]
            return
        self.joining[slot] = time.monotonic()

    def _joiners_due(self) -> bool:
        """Replacements join when every one started is up, or once one has waited JOIN_GRACE_S for another
        that is still starting (one join, one rebuild, for the replacements of a double loss)."""
        up = [t for t in self.joining.values() if t is not None]
        return bool(up) and (len(up) == len(self.joining) or time.monotonic() - min(up) > JOIN_GRACE_S)

    def _check_joiners(self) -> None:
        """A replacement that exited before joining is dropped (not replaced in turn: it would likely fail too)."""
        for slot, code in self.ranks.dead().items():
            if slot in self.joining:
                logger.warning("replacement rank %d %s before joining; not replaced", slot, _exit_text(code))
                del self.joining[slot]
                self.lost.add(slot)

    def _replace(self) -> None:
        """--elastic-ep-replace: start a replacement rank process for each rank lost while serving (once the
        survivors serve: its start would slow their re-formation); it says when it is up, and the survivors
        and it then re-form as one group again (step())."""
        while self._unreplaced and (self._spare is not None or self._next_slot < BOARD_SLOTS):
            if self._spare is not None:  # imported already: it joins in moments
                slot, self._spare = self._spare, None
            else:
                slot, self._next_slot = self._next_slot, self._next_slot + 1
            self._unreplaced -= 1
            logger.warning("starting rank %d to replace a lost rank (--elastic-ep-replace)", slot)
            self.ranks.spawn_replacement(slot)
            self.joining[slot] = None

    def _spawn_spare(self) -> None:
        """--elastic-ep-replace: keep one rank process started ahead (it imports torch and the engine, several
        seconds of CPU, then waits), so a replacement joins in moments. Started at start-up and after each
        join, not while ranks re-form or join (it would slow them)."""
        if self._spare is None and self._next_slot < BOARD_SLOTS:
            self._spare, self._next_slot = self._next_slot, self._next_slot + 1
            self.ranks.spawn_spare(self._spare)

    def _start_recovery(self) -> None:
        """Drop the dead rank(s) and take in the replacements that are up; tell each rank its rank in a new
        epoch with a fresh rendezvous."""
        dead = self._newly_dead()
        if self.recovery is None:  # which rank process each request ran on (a loss while re-forming: kept)
            self._owners = {rid: self.slots[dp] for rid, dp in self.router.owner.items()}
        self.lost.update(dead)
        for r, code in sorted(dead.items()):
            logger.warning("rank %d %s: the %d other ranks re-form without it (--enable-elastic-ep)", r,
                           _exit_text(code), len(self.slots) - len(dead))
        self.elastic_stats.elastic_ranks_lost += len(dead)
        self.slots[:] = [s for s in self.slots if s not in self.lost]  # in place: the finalizer holds the list
        up = sorted(s for s, t in self.joining.items() if t is not None)
        for s in up:
            del self.joining[s]
            self.slots.append(s)
            logger.warning("replacement rank %d joins epoch %d", s, self.epoch + 1)
        self.elastic_stats.elastic_ranks_replaced += len(up)
        if self.replace:  # a replacement lost before it ever served is not replaced in turn: it would likely
            self._unreplaced += sum(r in self._served for r in dead)  # fail again, and again
            for r in sorted(set(dead) - self._served):
                logger.warning("replacement rank %d was lost before it served; not replaced", r)
            self._awaiting -= set(dead)
            if self._unreplaced and self._spare is not None:  # imported already: it joins this re-formation
                slot, self._spare = self._spare, None
                self._unreplaced -= 1
                logger.warning("rank %d (the spare) replaces a lost rank in epoch %d (--elastic-ep-replace)", slot,
                               self.epoch + 1)
                self.ranks.spawn_replacement(slot)
                self.slots.append(slot)
                self._awaiting.add(slot)
                self.elastic_stats.elastic_ranks_replaced += 1
        self.epoch += 1
        self.dp_size = len(self.slots)
        # the epoch's rendezvous lives here (DPEngineClient._epoch_stores), not on a survivor that may die too
        host = self.config.parallel.master_addr
        self._epoch_stores.append(host_rendezvous(host, 0, datetime.timedelta(
            seconds=self.config.parallel.distributed_timeout)))
        init = f"tcp://{host}:{self._epoch_stores[-1].port}"
        self._epoch_init = init
        for dp in range(self.dp_size):
            if self.slots[dp] not in self._awaiting:  # the spare gets it when it says it is up (_joiner_report)
                self._send(dp, RankCommand(reform=RankReform(self.epoch, dp, self.dp_size, init)))
        started = self.recovery["started"] if self.recovery else time.monotonic()  # a loss while re-forming
        grow = not dead and self.recovery is None  # only replacements join: no loss to recover from
        self.recovery = {"waiting": set(range(self.dp_size)), "started": started, "epoch_at": time.monotonic(),
                         "grow": grow, "kept": {}, "early": []}
        self._beats = None
        self._reset_ranks()

    def _poll_recovery(self, poll_s: float) -> None:
        rec, timeout = self.recovery, self.config.parallel.elastic_ep_timeout
        timeout_ms = int(poll_s * 1000)
        while self.recovery is rec and self.sock.poll(timeout_ms):
            timeout_ms = 0
            report = self._recv()
            if report is not None and report.ready:
                rec["waiting"].discard(report.dp_rank)
                rec["kept"][report.dp_rank] = report.kept
                self.num_kv_blocks = report.num_kv_blocks
            elif report is not None:  # a survivor that is ready steps on with the requests it kept (alone, or
                rec["early"].append(report)  # with others ready too): its tokens count after _adopt_kept
        if self.recovery is not rec:
            return  # another loss began a newer epoch
        if rec["waiting"] and any_compiling(self.board, self.slots):  # the epoch's decode graphs (every rank,
            rec["epoch_at"] = time.monotonic()  # in lockstep): --elastic-ep-timeout counts from their end
        if not rec["waiting"]:
            self._finish_recovery()
            for report in rec["early"]:  # only the requests that stayed on that rank (others were re-queued)
                report = msgspec.structs.replace(report, outputs=[
                    o for o in report.outputs if self.router.owner.get(o.request_id) == report.dp_rank])
                self._take_report(report, self._late)
        elif time.monotonic() - rec["epoch_at"] > timeout and not self._kill_laggards(timeout):
            self._fail(f"the {self.dp_size} surviving rank(s) did not re-form within {timeout:g} s "
                       f"(--elastic-ep-timeout); waiting for DP rank(s) {sorted(rec['waiting'])}")

    def _kill_laggards(self, timeout: float) -> bool:
        """A re-formation past --elastic-ep-timeout: kill the ranks the others wait on (their count of the
        epoch's collectives lags, as for a hung rank), so the next _check_alive re-forms without them. False
        when no rank can be named (all level: all stuck in the rendezvous or the build alike)."""
        if self._awaiting:  # a spare that never said it is up: the others wait for it at the store
            hung = sorted(self._awaiting)
        elif self.board is None:
            return False
        else:
            hung = hung_ranks({r: self.board.read(r) for r in self.slots}, self.epoch)
        if not hung or len(hung) == len(self.slots):
            return False
        for r in hung:
            logger.warning("rank %d did not re-form within %g s (--elastic-ep-timeout) while the other ranks of "
                           "epoch %d wait on it: killing it", r, timeout, self.epoch)
            self.ranks.kill_rank(r)
            self.hung_killed.append(r)
        return True

    def _finish_recovery(self) -> None:
        """The requests a survivor kept stay there; every other unfinished request goes to the survivors with
        its tokens so far (issue 31's resume)."""
        took, grow, kept = time.monotonic() - self.recovery["started"], self.recovery["grow"], self.recovery["kept"]
        self.recovery = None
        self._served.update(self.slots)
        self._beats = None  # the hang check starts afresh in the new epoch
        st = self.elastic_stats
        if not grow:  # from a loss seen to the survivors serving (a replacement joining is not a recovery)
            st.elastic_last_recovery_s = took
            st.elastic_recovery_s += took
        staying = self._adopt_kept(kept)
        for rid, (req, seen) in self.requests.items():
            if rid in staying:
                continue
            out = list(req.output_token_ids) + seen
            params = req.sampling_params
            if seen and params.prompt_logprobs is not None:
                params = dataclasses.replace(params, prompt_logprobs=None)  # the caller has them already
            # a survivor's own request goes back to it: its engine core kept the prefix cache, so the recompute
            # of the prompt and the output so far is mostly cache hits (engine/elastic.py, roll_back)
            owner = self._owners.get(rid)
            rank = self.slots.index(owner) if owner in self.slots else None
            self._route(msgspec.structs.replace(req, sampling_params=params, output_token_ids=out), rank)
            st.elastic_requeued += 1
            st.elastic_tokens_recomputed += len(req.prompt_token_ids) + len(out)
        self._owners = {}
        self._last_progress = time.monotonic()
        logger.warning("epoch %d: %d rank(s) serve again after %.2f s; %d request(s) kept where they ran, %d "
                       "re-queued", self.epoch, self.dp_size, took, len(staying), len(self.requests) - len(staying))
        self._replace()
        if self.replace and not self.joining:
            self._spawn_spare()

    def _adopt_kept(self, kept: dict[int, dict[str, int]]) -> set[str]:
        """The requests the survivors kept scheduled (their ready reports: DP rank -> {request id: output
        tokens}) that stay there: unfinished here with exactly the tokens seen here (a survivor's outputs of the
        older epoch are read before its ready report: _late_outputs). The router counts them on that rank.
        Others a survivor holds are aborted there: finished or aborted here meanwhile (the abort was dropped
        with the older epoch), or out of step with what was seen (re-queued then, as a lost rank's)."""
        staying: set[str] = set()
        for dp, held in sorted(kept.items()):
            aborts = []
            for rid, n in held.items():
                entry = self.requests.get(rid)
                if entry is None or rid in staying or len(entry[0].output_token_ids) + len(entry[1]) != n:
                    aborts.append(rid)
                    continue
                req, seen = entry
                staying.add(rid)
                prompt = req.prompt_token_ids + list(req.output_token_ids) + seen
                max_new = max(1, (req.sampling_params.max_tokens or self.config.scheduler.max_model_len) - n)
                self.router.assign(rid, 0, max_new, prompt, rank=dp)  # nothing to prefill: its KV is there
            if aborts:  # before any re-queue of the same id: the rank applies its commands in order
                self._send(dp, RankCommand(aborts=aborts, abort_status=RequestStatus.FINISHED_ABORTED.value))
        return staying

    def _late_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """Tokens a survivor made in an older epoch, read after the loss was seen: the survivor keeps those
        requests with them (RankReport.kept), so they are the caller's (next step()) and count as seen. A lost
        rank's are dropped: its requests are re-queued with the tokens seen before."""
        for out in outputs:
            entry = self.requests.get(out.request_id)
            if entry is None:
                continue  # aborted here already
            entry[1].extend(out.new_token_ids)
            out.num_cached_tokens = self._first_cached.setdefault(out.request_id, out.num_cached_tokens)
            if out.finish_reason is not None:
                self.requests.pop(out.request_id, None)
                self._first_cached.pop(out.request_id, None)
            self._late.append(out)

    def _take_late(self) -> list[EngineCoreOutput]:
        late, self._late = self._late, []
        return late
