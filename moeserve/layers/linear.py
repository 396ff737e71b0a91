"""Linear layers. Kept as our own module so quantized and tensor-parallel variants swap in by name.

Tensor parallelism: a Linear built with tp_dim=0 holds rows [rank * out/T, (rank+1) * out/T) of the
checkpoint weight (column parallel: its output is this rank's share of heads); tp_dim=1 holds a slice of
the input columns (row parallel: the caller all-reduces the partial outputs over the TP group).
"""
import torch
import torch.nn.functional as F
from torch import nn

from moeserve.layers import onednn_linear
from moeserve.layers.opaque import define_op


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A BF16 weight [out, in] in oneDNN's blocked layout, made once at load, or None where that does not apply
    (not CPU, not BF16, no oneDNN). Its GEMMs give F.linear's results bit for bit and read the weight 1.3-2x
    faster at the few rows of a decode step (measured: benchmarks/packed_linear.py); at prefill sizes equal."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


def zen_pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A BF16 weight [out, in] prepacked for zentorch's linear (AMD CPUs with zentorch: layers/moe/zen.py), or
    None. Our own copy, so none of zentorch's address-keyed weight cache is involved. Against the oneDNN-packed
    copy, with cold weights, one thread: 1.05-1.4x faster at 1-32 rows over the bench model's shapes (lm_head
    [32000 x 1024] 4.77 -> 3.53 ms at 1 row), equal at prefill sizes (docs/engine.md)."""
    from moeserve.layers.moe import zen

    if not zen.usable(weight):
        return None
    return torch.ops.zentorch.zentorch_weight_prepack_for_linear(weight.detach().contiguous())


def packed_copy_bytes(model: nn.Module) -> int:
    """Bytes of the packed weight copies made for `model` (beside its parameters, which module_bytes counts):
    oneDNN / zentorch packs of Linears and experts, the amx kernels' expert copies, and the copies zentorch
    reorders experts into: the memory-based KV sizing must leave room for them."""
    total = 0
    for module in model.modules():
        total += _copy_bytes(getattr(module, "weight_packed", None))
        total += _copy_bytes(getattr(module, "weight_zen", None))
        total += _copy_bytes(getattr(module, "weight_amx", None))
        total += _copy_bytes(getattr(module, "w_uk_packed", None)) + _copy_bytes(getattr(module, "w_uv_packed", None))
        if getattr(module, "weight_onednn", None) is not None:  # the library handler's copy of the weight
            total += module.weight.numel() * module.weight.element_size()
        for pair in getattr(module, "packed", None) or ():  # FusedExperts: (w13, w2) per slot
            total += sum(_copy_bytes(t) for t in pair)
        for copy in getattr(module, "fused_weights", None) or ():  # FusedExperts on amx: its layout's copies
            total += _copy_bytes(copy)
        if getattr(module, "fused", "") == "zentorch":  # the copies zentorch's cache makes on first use
            from moeserve.layers.moe import zen
            total += zen.cache_bytes(module.w13, module.w2)
    return total


def _copy_bytes(copy) -> int:
    """A packed BF16 tensor, or an object that knows its size (layers/quant.py's Int8Packed)."""
    if copy is None:
        return 0
    if isinstance(copy, torch.Tensor):
        elements = copy.numel() * copy.element_size()
        try:  # zentorch's INT8 pack holds more than its elements in its storage
            return max(elements, copy.untyped_storage().nbytes())
        except NotImplementedError:  # oneDNN's packed (opaque) tensors have no storage to ask
            return elements
    return copy.nbytes


def _linear_shape(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


@define_op("packed_linear", "(Tensor x, Tensor packed, Tensor? bias) -> Tensor", _linear_shape)
def _packed_linear_op(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@define_op("zen_linear", "(Tensor x, Tensor packed, Tensor? bias) -> Tensor", _linear_shape)
def _zen_linear_op(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.zentorch.zentorch_linear_unary(x, packed, bias, is_weight_prepacked=True)


def zen_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias) with W prepacked by zen_pack_weight; an op of ours in a compiled graph."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if torch.compiler.is_compiling():
        y = torch.ops.moeserve.zen_linear(x2, packed, bias)
    else:
        y = torch.ops.zentorch.zentorch_linear_unary(x2, packed, bias, is_weight_prepacked=True)
    return y.view(*x.shape[:-1], packed.shape[0])


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ packed^T (+ bias). In a compiled graph through an op of ours: inductor lowers oneDNN's
    linear only for frozen (constant) weights, and the graphs keep the weights as inputs (one copy each)."""
    x2 = x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling():
        y = torch.ops.moeserve.packed_linear(x2, packed, bias)
    else:
        y = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], packed.shape[0])


class Linear(nn.Module):
    """y = x W^T (+ b), weight stored [out_features, in_features] as in the checkpoint.

    A quantization method (layers/quant.py) may take over the weights: it then owns their layout, loading
    (load_tensor) and the matmul (apply); the float path below is the unquantized case.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_dim: int | None = None, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        if tp_dim is not None and tp_size > 1:
            full = out_features if tp_dim == 0 else in_features
            assert full % tp_size == 0, f"dim {full} does not split over {tp_size} TP ranks"
            if tp_dim == 0:
                out_features //= tp_size
            else:
                in_features //= tp_size
        self.in_features, self.out_features = in_features, out_features
        self.tp_dim, self.tp_rank, self.tp_size = tp_dim, tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        # A row-parallel bias is added once, after the all-reduce, so only rank 0 keeps it.
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.quant_method = None

    def tp_slice(self, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor for `param_name` (weight, bias, or a per-output-row
        leaf such as an INT8 weight_scale)."""
        if self.tp_dim is None or self.tp_size == 1:
            return tensor
        if param_name == "weight":
            return tensor.chunk(self.tp_size, dim=self.tp_dim)[self.tp_rank]
        if self.tp_dim == 0:  # per-output-row leaves follow the output rows
            return tensor.chunk(self.tp_size, dim=0)[self.tp_rank]
        if param_name == "bias":
            return tensor if self.tp_rank == 0 else torch.zeros_like(tensor)
        return tensor  # row parallel: every rank has all output rows

    def load_tied(self, weight: torch.Tensor) -> None:
        """Take a weight shared with another module (lm_head tied to the embeddings): shared as is in float,
        a quantized copy when a quantization method owns this layer (the embedding stays float)."""
        if self.quant_method is None:
            self.weight = weight
        else:
            self.quant_method.load_tensor(self, "weight", weight.detach(), "lm_head.weight (tied)")

    def process_weights_after_loading(self) -> None:
        """A quantization method may lay its weights out for its kernels once loaded (INT8: oneDNN packing)."""
        prepare = getattr(self.quant_method, "process_weights_after_loading", None)
        if prepare is not None:
            prepare(self)
        elif self.quant_method is None:
            # AMD CPUs with zentorch; else vLLM's library's oneDNN matmul; else PyTorch's oneDNN packing
            self.weight_zen = zen_pack_weight(self.weight)
            use_library = self.weight_zen is None and onednn_linear.usable(self.weight)
            self.weight_onednn = onednn_linear.handler(self.weight) if use_library else None
            self.weight_packed = (pack_weight(self.weight) if self.weight_zen is None and not use_library
                                  else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x)
        handle = getattr(self, "weight_onednn", None)
        if handle is not None:
            return onednn_linear.linear(x, handle, self.out_features, self.bias)
        packed = getattr(self, "weight_packed", None)
        if packed is not None:
            return packed_linear(x, packed, self.bias)
        packed = getattr(self, "weight_zen", None)
        if packed is not None:
            return zen_linear(x, packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight [out, in] in the model dtype, whatever its storage (e.g. MLA's absorbed matrices)."""
        if self.quant_method is not None:
            return self.quant_method.dequantized_weight(self)
        return self.weight.detach()

    def extra_repr(self) -> str:
        q = "" if self.quant_method is None else f", quant={self.quant_method.__name__}"
        tp = f", tp_dim={self.tp_dim} ({self.tp_rank}/{self.tp_size})" if self.tp_size > 1 else ""
        return f"in={self.in_features}, out={self.out_features}{q}{tp}"
