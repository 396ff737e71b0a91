"""--speculative-config parsing and the errors a user sees."""
import argparse
import json

import pytest

from moeserve import LLM
from moeserve.config import ConfigError, SpeculativeConfig
from moeserve.engine_args import EngineArgs
from moeserve.models.loader import CheckpointError


def parse(argv):
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli(parser.parse_args(argv), model=None)


def test_flag_takes_vllm_json_and_defaults_to_one_token():
    args = parse(["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 3})])
    assert SpeculativeConfig.from_value(args.speculative_config) == SpeculativeConfig("mtp", 3)
    assert SpeculativeConfig.from_value({"method": "deepseek_mtp"}) == SpeculativeConfig("mtp", 1)
    assert parse([]).speculative_config is None


@pytest.mark.parametrize("value, words", [
    ("{not json", "must be a JSON object"),
    ('["mtp"]', "must be a JSON object"),
    ('{"method": "eagle"}', "method must be one of"),
    ('{"method": "mtp", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "mtp", "num_speculative_tokens": "2"}', "num_speculative_tokens"),
    ('{"method": "mtp", "num_tokens": 2}', "unknown key(s) num_tokens"),
    ('{"num_speculative_tokens": 2}', 'needs a "method"'),
])
def test_bad_values_name_the_flag(value, words):
    with pytest.raises(ConfigError) as e:
        SpeculativeConfig.from_value(value)
    assert "--speculative-config" in str(e.value) and words in str(e.value)


def test_checkpoint_without_mtp_layer_is_a_clear_error(ckpt_dir):
    with pytest.raises(CheckpointError, match=r"--speculative-config.*model\.layers\.3\."):
        LLM(ckpt_dir("v3"), dtype="float32", speculative_config={"method": "mtp"})


def test_checkpoint_without_mtp_layer_is_refused_before_dp_ranks_start(ckpt_dir):
    # With ranks, every rank would load the model and fail on its own (tracebacks, EngineDeadError).
    with pytest.raises(ConfigError, match=r"--speculative-config.*model\.layers\.3\."):
        LLM(ckpt_dir("v3"), dtype="float32", speculative_config={"method": "mtp"}, data_parallel_size=2,
            enable_expert_parallel=True)


def test_llm_keyword_builds_the_mtp_layer(mtp_ckpt_dir):
    llm = LLM(mtp_ckpt_dir("v3"), dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert llm.engine.config.speculative == SpeculativeConfig("mtp", 2)
    assert llm.engine.runner.proposer is not None
    assert not llm.engine.runner.checkpoint.mtp_weights  # copied in, then freed
