"""kiln's op set: every op a program may contain, defined once, with a version.

Each op has named inputs (``name?`` optional, ``*name`` variadic and last), a number of outputs, typed attributes
with defaults, and a docstring that states its semantics. The exporter lowers ATen to these ops; every backend
implements them; the loader checks every node of a file against this table.

Conventions shared by all ops unless the doc says otherwise:
- Elementwise binary ops take inputs of one dtype (the exporter inserts casts to do PyTorch's type promotion)
  and broadcast as NumPy and PyTorch do.
- Dimension arguments are already normalized to be non-negative.
- ``SYMINT``/``SYMINTS`` attributes hold static ints or expressions over the method's symbols.

Changes are additive: a new op or a new attribute with a default bumps ``OPSET_VERSION``; nothing is renamed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

OPSET_VERSION = 15
"""History: 1 the first op set; 2 conv gained padding_end and a fused activation (activation, activation_min,
activation_max); index_put, index_copy and slice_scatter gained in_place; quantized_linear and
quantized_embedding (weight-only int8/int4), rope and gated_activation were added; 3 rope gained interleaved;
4 add_rms_norm was added; 5 rope_cache_update was added; 6 gated_linear and add_rms_norm_linear were added;
7 slot_attention was added; 8 quantized_linear and quantized_embedding gained offset (GGUF's and MLX's
additive per-group term, so files quantized elsewhere are stored exactly); 9 gated_quantized_linear and
add_rms_norm_quantized_linear were added (gated_linear's and add_rms_norm_linear's forms for quantized weights);
10 gathered_linear and gathered_quantized_linear were added (a mixture-of-experts layer's experts: each row
through the expert its router picked); 11 route_experts was added (a mixture-of-experts router's softmax, top-k
and renormalization as one node) and gathered_linear and gathered_quantized_linear gained combine (the weighted sum
of each token's k expert rows); 12 norm_rope_cache_update was added (rope_cache_update of q and k each
RMS-normalized per head first: the q/k norms of Qwen3 and Gemma 3 folded into the step's one node); 13
gated_gathered_linear was added (a gathered_linear over stacked gate/up experts and the gated activation after it,
as gated_linear is to linear); 14 add_rms_norm_route_experts was added (a MoE block's residual add and RMSNorm,
its router's linear layer and route_experts as one node); 15 sdpa and slot_attention gained sinks (per-head sink
logits: gpt-oss's attention as one node, served from slots too)."""


class AttrType(enum.IntEnum):
    """Attribute type; the value is its code in the file."""

    INT = 0
    FLOAT = 1
    STRING = 2
    BOOL = 3
    DTYPE = 4
    INTS = 5
    FLOATS = 6
    SYMINT = 7
    SYMINTS = 8


REQUIRED = object()
"""Default of an attribute that every node must set."""


@dataclass(frozen=True)
class AttrDef:
    name: str
    type: AttrType
    default: Any = REQUIRED
    """REQUIRED, None (optional: absent means 'not given'), or the value used when the node omits it."""


@dataclass(frozen=True)
class InputDef:
    name: str
    optional: bool = False
    variadic: bool = False


@dataclass(frozen=True)
class OpDef:
    name: str
    inputs: tuple[InputDef, ...]
    attrs: tuple[AttrDef, ...]
    num_outputs: int
    doc: str
    attr_map: dict[str, AttrDef] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "attr_map", {a.name: a for a in self.attrs})

    @property
    def min_inputs(self) -> int:
        return sum(1 for i in self.inputs if not i.optional and not i.variadic)

    @property
    def max_inputs(self) -> int | None:
        return None if any(i.variadic for i in self.inputs) else len(self.inputs)

    def signature(self) -> str:
        ins = ", ".join(("*" if i.variadic else "") + i.name + ("?" if i.optional else "") for i in self.inputs)
        ats = ", ".join(f"{a.name}: {a.type.name.lower()}" for a in self.attrs)
        return f"{self.name}({ins}{'; ' + ats if ats else ''}) -> {self.num_outputs}"


OPS: dict[str, OpDef] = {}


def define(name: str, inputs: str, *attrs: AttrDef, outputs: int = 1, doc: str) -> OpDef:
    """Add one op to the table; defining a name twice is a bug."""
    if name in OPS:
        raise ValueError(f"op {name!r} defined twice")
    parsed = []
    for spec in inputs.split():
        variadic, optional = spec.startswith("*"), spec.endswith("?")
        parsed.append(InputDef(spec.strip("*?"), optional=optional, variadic=variadic))
    OPS[name] = OpDef(name, tuple(parsed), tuple(attrs), outputs, doc)
    return OPS[name]


A, T = AttrDef, AttrType

# ---- elementwise unary: y = f(x), same dtype and shape ----
UNARY = {
    "neg": "-x", "abs": "|x|", "exp": "e^x", "log": "natural log", "sqrt": "square root",
    "rsqrt": "1/sqrt(x)", "reciprocal": "1/x", "sigmoid": "1/(1+e^-x)", "tanh": "hyperbolic tangent",
    "relu": "max(x, 0)", "erf": "error function", "sin": "sine", "cos": "cosine", "floor": "round down",
    "ceil": "round up", "round": "round half to even", "sign": "-1, 0 or 1", "silu": "x * sigmoid(x)",
    "hardswish": "x * clamp(x + 3, 0, 6) / 6", "hardsigmoid": "clamp(x + 3, 0, 6) / 6",
    "logical_not": "not x (bool in, bool out)", "bitwise_not": "~x (integers and bool)",
    "log1p": "log(1 + x)", "expm1": "e^x - 1", "trunc": "round toward zero", "isnan": "x != x (bool out)",
}
for _name, _sem in UNARY.items():
    define(_name, "x", doc=f"Elementwise {_sem}.")

define("gelu", "x", A("approximate", T.STRING, "none"),
       doc="GELU: x * Phi(x) exactly ('none') or with the tanh approximation ('tanh').")
define("gated_activation", "gate up", A("activation", T.STRING),
       doc="act(gate) * up, the gated MLP of Llama-style models (SwiGLU, GeGLU); gate and up have one shape. "
           "activation: silu, gelu (erf) or gelu_tanh.")
define("leaky_relu", "x", A("negative_slope", T.FLOAT, 0.01), doc="x if x > 0 else negative_slope * x.")
define("clamp", "x", A("min", T.FLOAT, None), A("max", T.FLOAT, None),
       doc="Clamp to [min, max]; an absent bound is not applied. NaN stays NaN.")
define("cast", "x", A("dtype", T.DTYPE), doc="Convert to dtype as PyTorch's .to(dtype) does (float->int truncates).")

# ---- elementwise binary: same dtype in, broadcast ----
BINARY = {
    "add": "a + b", "sub": "a - b", "mul": "a * b", "pow": "a ** b", "maximum": "max(a, b), NaN-propagating",
    "minimum": "min(a, b), NaN-propagating", "remainder": "a mod b with the sign of b (Python %)",
    "fmod": "a mod b with the sign of a (C fmod)", "bitwise_and": "a & b", "bitwise_or": "a | b",
    "bitwise_xor": "a ^ b", "logical_and": "a and b (bool)", "logical_or": "a or b (bool)",
    "logical_xor": "a xor b (bool)", "atan2": "atan2(a, b)",
}
for _name, _sem in BINARY.items():
    define(_name, "a b", doc=f"Elementwise {_sem}; inputs share one dtype and broadcast.")
define("div", "a b", A("rounding_mode", T.STRING, "none"),
       doc="a / b; rounding_mode 'none' (true division, float inputs), 'floor' or 'trunc' (any dtype).")

COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
for _name, _sem in COMPARE.items():
    define(_name, "a b", doc=f"Elementwise a {_sem} b; inputs share one dtype and broadcast; output bool.")

define("where", "cond a b", doc="cond ? a : b elementwise; cond is bool, a and b share one dtype; all broadcast.")

# ---- reductions ----
_REDUCE_ATTRS = (A("dims", T.INTS, ()), A("keepdim", T.BOOL, False))
for _name, _sem in {"sum": "sum", "mean": "mean", "prod": "product", "amax": "maximum", "amin": "minimum",
                    "any": "logical or (bool out)", "all": "logical and (bool out)"}.items():
    define(_name, "x", *_REDUCE_ATTRS,
           doc=f"Reduce by {_sem} over dims (empty dims: all dims); keepdim keeps them as size 1.")
define("var", "x", *_REDUCE_ATTRS, A("correction", T.FLOAT, 1.0),
       doc="Variance over dims with Bessel-style correction (divisor N - correction).")
for _name in ("argmax", "argmin"):
    define(_name, "x", A("dim", T.INT, None), A("keepdim", T.BOOL, False),
           doc=f"Index (int64) of the first {_name[3:]}imum along dim, or of the flattened tensor if dim is absent.")
define("cumsum", "x", A("dim", T.INT), doc="Cumulative sum along dim.")
define("softmax", "x", A("dim", T.INT), doc="exp(x - max) / sum(exp(x - max)) along dim.")
define("log_softmax", "x", A("dim", T.INT), doc="x - max - log(sum(exp(x - max))) along dim.")

# ---- linear algebra ----
define("matmul", "a b", doc="Matrix product with PyTorch/NumPy matmul semantics (1-d promotion, batch broadcast).")
define("linear", "x weight bias?",
       doc="x @ weight.T + bias; weight is [out, in]; x is [..., in]. The weight is never transposed in the file.")

_QUANT_DOC = ("The weight W [N, K] is stored weight-only quantized in groups of `group_size` consecutive elements of a "
              "row (group_size == K: one group per row, i.e. per output channel): W[n, k] = (q[n, k] - zero[n, g]) "
              "* scale[n, g] with g = k // group_size; scale (float) and zero (float, optional) are [N, K / "
              "group_size]. bits 8: q is int8 [N, K], an absent zero means 0. bits 4: q is uint8 [N, K / 2], "
              "element 2j in the low nibble and 2j + 1 in the high one, values 0..15; an absent zero means 8. "
              "offset: zero holds an additive term per group instead, W[n, k] = q[n, k] * scale[n, g] + zero[n, g] "
              "(GGUF's Q4_1/K-quant min, MLX's bias; q as stored, no implicit 8), an absent zero meaning 0.")
_OFFSET = A("offset", T.BOOL, False)
define("quantized_linear", "x q scale zero? bias?", A("bits", T.INT), A("group_size", T.INT), _OFFSET,
       doc="linear (x @ W.T + bias) with a quantized weight. " + _QUANT_DOC + " Output dtype: scale's.")

# ---- convolution and pooling (N spatial dims, channels first) ----
define("conv", "x weight bias?", A("stride", T.INTS), A("padding", T.INTS), A("dilation", T.INTS),
       A("groups", T.INT, 1), A("transposed", T.BOOL, False), A("output_padding", T.INTS, ()),
       A("padding_end", T.INTS, ()), A("activation", T.STRING, "none"), A("activation_min", T.FLOAT, None),
       A("activation_max", T.FLOAT, None),
       doc="N-d convolution (cross-correlation) or, when transposed, its adjoint, as aten.convolution. "
           "x [N, C, *spatial]; weight [O, C/groups, *k] (transposed: [C, O/groups, *k]). padding is zeros "
           "before each spatial dim; padding_end, when given (not transposed), the zeros after it (else equal "
           "to padding). activation is applied to the result, bias included: none, clamp (to [activation_min, "
           "activation_max], an absent bound not applied, NaN kept) or hardswish.")
define("max_pool", "x", A("kernel", T.INTS), A("stride", T.INTS), A("padding", T.INTS),
       A("dilation", T.INTS), A("ceil_mode", T.BOOL, False),
       doc="N-d max pooling over the trailing len(kernel) dims; padding is -inf; windows starting in the "
           "right padding are dropped in ceil_mode as PyTorch does.")
define("avg_pool", "x", A("kernel", T.INTS), A("stride", T.INTS), A("padding", T.INTS),
       A("ceil_mode", T.BOOL, False), A("count_include_pad", T.BOOL, True), A("divisor", T.INT, None),
       doc="N-d average pooling over the trailing len(kernel) dims with PyTorch's divisor rules.")

# ---- normalization ----
define("layer_norm", "x weight? bias?", A("axes", T.INT), A("eps", T.FLOAT, 1e-5),
       doc="Normalize over the last `axes` dims: (x - mean) / sqrt(var + eps) * weight + bias.")
define("rms_norm", "x weight?", A("axes", T.INT), A("eps", T.FLOAT, None),
       doc="x / sqrt(mean(x^2 over the last `axes` dims) + eps) * weight; eps absent: the dtype's epsilon.")
define("add_rms_norm", "x residual weight?", A("axes", T.INT), A("eps", T.FLOAT, None), outputs=2,
       doc="(s, rms_norm(s)) for s = x + residual, rounded to the dtype as add would: a transformer block's "
           "residual add and the RMSNorm after it, in one pass. x and residual have one shape and one float dtype.")
_GATED_LINEAR_DOC = ("linear(x, weight, bias) over a weight stacking the gate's N rows and then the up's N rows, "
                     "each half rounded to the dtype as linear rounds it, then gated_activation(gate, up)")
define("gated_linear", "x weight bias?", A("activation", T.STRING),
       doc=f"{_GATED_LINEAR_DOC}: the gated MLP's projection and activation in one node, out [..., N]. "
           "activation as gated_activation's.")
define("add_rms_norm_linear", "x residual norm_weight? weight bias?", A("axes", T.INT), A("eps", T.FLOAT, None),
       A("activation", T.STRING, ""), outputs=2,
       doc="(s, linear(n, weight, bias)) for (s, n) = add_rms_norm(x, residual, norm_weight): a pre-norm block's "
           "residual add, its RMSNorm and the projection that is the norm's only reader, in one node (axes is 1). "
           f"With an activation the projection is gated_linear's: {_GATED_LINEAR_DOC}.")
_QUANT_ATTRS = (A("bits", T.INT), A("group_size", T.INT), _OFFSET)
define("gated_quantized_linear", "x q scale zero? bias?", *_QUANT_ATTRS, A("activation", T.STRING),
       doc="gated_linear with a quantized weight (quantized_linear's q, scale, zero and attributes) stacking the "
           "gate's N rows and then the up's N rows: quantized_linear, each half rounded to scale's dtype, then "
           "gated_activation(gate, up), out [..., N].")
define("add_rms_norm_quantized_linear", "x residual norm_weight? q scale zero? bias?", A("axes", T.INT),
       A("eps", T.FLOAT, None), *_QUANT_ATTRS, A("activation", T.STRING, ""), outputs=2,
       doc="add_rms_norm_linear with a quantized weight: (s, quantized_linear(n, q, scale, zero, bias)) for (s, n) "
           "= add_rms_norm(x, residual, norm_weight), axes 1; with an activation the projection is "
           "gated_quantized_linear's.")
_GATHERED_DOC = ("A linear layer chosen per row from a stack of E of them (a mixture-of-experts layer's experts): x "
                 "[S, K], index int64 [S] with values in [0, E), out[s] = x[s] @ W[index[s]].T + bias[index[s]], "
                 "[S, N]. A backend reads only the weights of the experts the rows pick, once per expert however "
                 "many rows pick it. With combine [T, k] (S = T * k, a token's k rows consecutive) the result is "
                 "each token's weighted sum instead, [T, N]: out[t] = sum over j of combine[t, j] * row t * k + j, "
                 "each row and each product rounded to the output dtype, the sum in float32 rounded once (the "
                 "multiply and the sum of the MoE layer it stands for).")
define("gathered_linear", "x weight index bias? combine?",
       doc=f"{_GATHERED_DOC} weight [E, N, K] and bias [E, N] share x's float dtype.")
define("gated_gathered_linear", "x weight index bias?", A("activation", T.STRING),
       doc="gathered_linear (no combine) over expert weights [E, 2N, K] each stacking the gate's N rows and then the "
           "up's N rows (bias [E, 2N]), each half rounded to the dtype as gathered_linear rounds it, then "
           "gated_activation(gate, up): a mixture-of-experts layer's gate/up projection and its activation in one "
           "node, out [S, N]. activation as gated_activation's.")
define("gathered_quantized_linear", "x q scale zero? index bias? combine?", *_QUANT_ATTRS,
       doc=f"{_GATHERED_DOC} Each expert's weight is quantized as quantized_linear's: q [E, N, K] (int8) or [E, N, "
           "K / 2] (int4), scale and zero [E, N, K / group_size], W[e] = quantized_linear's W of (q[e], scale[e], "
           "zero[e]); bias [E, N] and combine in scale's dtype, as out.")
define("batch_norm", "x weight? bias? mean var", A("eps", T.FLOAT, 1e-5),
       doc="Inference batch norm over dim 1: (x - mean) / sqrt(var + eps) * weight + bias.")

# ---- attention ----
define("rope", "x cos sin", A("interleaved", T.BOOL, False),
       doc="Rotary position embedding: x * cos + rotate(x) * sin over the last dim D; cos and sin broadcast "
           "against x. rotate(x) = cat(-x[..., D/2:], x[..., :D/2]) (rotate-half, Llama), or with interleaved "
           "the pairs (x[2i], x[2i+1]) -> (-x[2i+1], x[2i]) (GPT-J).")
define("sdpa", "q k v mask? sinks?", A("causal", T.BOOL, False), A("scale", T.FLOAT, None),
       doc="softmax(q @ k^T * scale + mask) @ v over [..., L, E] / [..., S, E]; scale absent: 1/sqrt(E). "
           "causal masks j > i (top-left aligned); a bool mask keeps True; a float mask is added. "
           "k/v with fewer heads than q (dim -3) are shared by groups of q heads (GQA). sinks [Hq] (a float "
           "dtype): each q head's sink logit, one more term in its softmax's sum that has no value (gpt-oss): "
           "out = sum_j exp(s_j - M) v_j / (sum_j exp(s_j - M) + exp(sink - M)), so a query that sees no key gets "
           "zeros where without sinks it gets NaN.")
define("slot_attention", "q k_cache v_cache slots positions sinks?", A("scale", T.FLOAT), A("window", T.INT, 0),
       doc="Causal attention of B sequences over a KV cache of N slots, each sequence in its own slot: q [B, Hq, "
           "T, E], k_cache [N, S, Hkv, E], v_cache [N, S, Hkv, Ev], slots int64 [B], positions int64 [B, T] in "
           "[0, S); out [B, Hq, T, Ev] in q's dtype. Query (b, h, t) attends the keys k_cache[slots[b], j, h // "
           "(Hq / Hkv)] at j <= positions[b, t] (and j > positions[b, t] - window when window > 0), as "
           "softmax(q k^T * scale) v. A decode step over several sequences (T = 1) and a prompt chunk of one "
           "(B = 1) are the same op; a backend reads only the slots and keys the positions reach. sinks [Hq]: each q "
           "head's sink logit, as sdpa's.")

# ---- shape and view ops ----
define("reshape", "x", A("shape", T.SYMINTS), doc="Same elements in row-major order, new shape.")
define("permute", "x", A("perm", T.INTS), doc="Reorder dims: out.shape[i] = x.shape[perm[i]].")
define("expand", "x", A("shape", T.SYMINTS), doc="Broadcast x to shape (x right-aligned, size-1 dims stretch).")
define("slice", "x", A("dim", T.INT), A("start", T.SYMINT), A("end", T.SYMINT), A("step", T.INT, 1),
       doc="Elements start <= i < end (already clamped to [0, size]) by step > 0 along dim.")
define("cat", "*xs", A("dim", T.INT), doc="Concatenate along dim; inputs share a dtype.")
define("flip", "x", A("dims", T.INTS), doc="Reverse the order along each of dims.")
define("pad", "x", A("pads", T.INTS), A("mode", T.STRING, "constant"), A("value", T.FLOAT, 0.0),
       doc="Pad as torch.nn.functional.pad: pads are (before, after) pairs from the last dim backwards; "
           "negative pads crop. mode: constant, reflect, replicate.")
define("tril", "x", A("diagonal", T.INT, 0), doc="Zero elements above the diagonal of the last two dims.")
define("triu", "x", A("diagonal", T.INT, 0), doc="Zero elements below the diagonal of the last two dims.")

# ---- indexing ----
define("index_select", "x index", A("dim", T.INT), doc="x gathered along dim at the 1-d int index.")
define("gather", "x index", A("dim", T.INT), doc="out[i][j][k] = x[i][index[i][j][k]][k] for dim 1, and so on.")
define("embedding", "weight indices", doc="weight[indices]: rows of a [V, D] table, out shape indices.shape + [D].")
define("quantized_embedding", "q scale zero? indices", A("bits", T.INT), A("group_size", T.INT), _OFFSET,
       doc="embedding of the rows of a quantized [V, D] table W (quantized as in quantized_linear, N = V, K = D): "
           "W[indices], dequantized, in scale's dtype.")
define("index", "x *indices", A("dims", T.INTS),
       doc="Advanced indexing: x[..., idx0, ..., idx1, ...] with int index tensors at dims (sorted, broadcast "
           "together), as aten.index.Tensor with None for the dims not listed.")
_IN_PLACE = A("in_place", T.BOOL, False)
_IN_PLACE_DOC = (" in_place: x is a state buffer that nothing reads after this node, and the result replaces it; a "
                 "backend may write into x's memory and return it instead of copying (the KV-cache update).")
define("index_put", "x values *indices", A("dims", T.INTS), A("accumulate", T.BOOL, False), _IN_PLACE,
       doc="Copy of x with x[indices at dims] = values (or += when accumulate), as aten.index_put. An index may "
           "be a bool mask, covering mask.ndim dims from its dim (values then broadcast to the selected elements)."
           + _IN_PLACE_DOC)
define("index_copy", "x index source", A("dim", T.INT), _IN_PLACE,
       doc="Copy of x with x.select(dim, index[i]) = source.select(dim, i)." + _IN_PLACE_DOC)
define("slice_scatter", "x source", A("dim", T.INT), A("start", T.SYMINT), A("end", T.SYMINT),
       A("step", T.INT, 1), _IN_PLACE, doc="Copy of x with the slice (as in `slice`) replaced by source."
                                            + _IN_PLACE_DOC)
define("rope_cache_update", "q k v cos sin k_cache v_cache *indices", A("dims", T.INTS),
       A("interleaved", T.BOOL, False), _IN_PLACE, outputs=3,
       doc="(rope(q), k_cache with k_cache[indices at dims] = rope(k), v_cache with v_cache[indices at dims] = v): "
           "the attention inputs of a step over a KV cache, as rope and index_put compute them, in one node. rope "
           "as the rope op (cos and sin broadcast against q and k, interleaved alike); the writes as index_put "
           "without accumulation, repeated slots keeping the last. in_place: both caches are state buffers that "
           "nothing reads after this node, each result replacing its buffer; a backend may write into their memory.")
define("norm_rope_cache_update", "q k v cos sin k_cache v_cache q_weight k_weight *indices", A("dims", T.INTS),
       A("interleaved", T.BOOL, False), A("eps", T.FLOAT, None), _IN_PLACE, outputs=3,
       doc="rope_cache_update(rms_norm(q, q_weight), rms_norm(k, k_weight), v, ...) with both norms over the last "
           "dim (one head's row) with eps, each rounded to the dtype as rms_norm rounds it: the q/k norms of "
           "Qwen3 and Gemma 3 and the step's RoPE and cache writes in one node. q_weight and k_weight are [D].")
define("scatter", "x index source", A("dim", T.INT), A("reduce", T.STRING, "none"),
       doc="Copy of x with out[index[i][j]][j] = source[i][j] for dim 0 (and so on); reduce: none, add.")

# ---- creation ----
define("arange", "", A("start", T.SYMINT), A("end", T.SYMINT), A("step", T.SYMINT, 1), A("dtype", T.DTYPE),
       doc="Integers start, start+step, ... < end as dtype.")
define("arange_float", "", A("start", T.FLOAT), A("end", T.FLOAT), A("step", T.FLOAT), A("dtype", T.DTYPE),
       A("length", T.SYMINT), doc="start + i * step for i < length, computed in float64 then cast to dtype.")
define("full", "", A("shape", T.SYMINTS), A("value", T.FLOAT), A("dtype", T.DTYPE),
       doc="A tensor of shape filled with value (cast to dtype).")
define("copy", "x", doc="An independent copy of x (used where a value must not alias its input).")


def get(name: str) -> OpDef:
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a kiln op (op set version {OPSET_VERSION})") from None


# ---- sorting, scans, searches and data-shaped gathers/scatters (A2) ----
define("sort", "x", A("dim", T.INT), A("descending", T.BOOL, False), outputs=2,
       doc="(values, int64 indices) sorted along dim, stably (ties keep their order); NaN sorts above +inf "
           "(last ascending, first descending), as torch.sort(stable=True).")
define("topk", "x", A("k", T.SYMINT), A("dim", T.INT), A("largest", T.BOOL, True), outputs=2,
       doc="(values, int64 indices) of the k largest (smallest) elements along dim, sorted; NaN counts as "
           "largest; ties go to the lower index.")
define("route_experts", "logits", A("k", T.INT), A("normalize", T.BOOL, False), A("dtype", T.DTYPE), outputs=2,
       doc="A mixture-of-experts router's pick over the last dim: p = softmax(logits in float32); (weights, int64 "
           "indices) = topk(p, k) as topk orders it (sorted, ties to the lower index); weights divided by their sum "
           "if normalize (float32); weights cast to dtype.")
define("add_rms_norm_route_experts", "x residual norm_weight? weight bias?", A("axes", T.INT), A("eps", T.FLOAT, None),
       A("k", T.INT), A("normalize", T.BOOL, False), A("dtype", T.DTYPE), outputs=4,
       doc="(s, n, weights, indices) for (s, n) = add_rms_norm(x, residual, norm_weight) (axes 1) and (weights, "
           "indices) = route_experts(linear(n as [R, D], weight, bias)) with R the product of x's leading dims: a "
           "mixture-of-experts block's residual add, its RMSNorm and its router's linear layer and pick in one node "
           "(n stays an output: the experts read it). weight [E, D]; weights and indices are [R, k].")
define("cumprod", "x", A("dim", T.INT), doc="Cumulative product along dim (small ints accumulate in int64).")
for _name in ("cummax", "cummin"):
    define(_name, "x", A("dim", T.INT), outputs=2,
           doc=f"(running {_name[3:]}imum, int64 index of the last element that set it) along dim; NaN propagates.")
define("logcumsumexp", "x", A("dim", T.INT), doc="log(cumsum(exp(x))) along dim, computed stably.")
define("scatter_reduce", "x index source", A("dim", T.INT), A("reduce", T.STRING), A("include_self", T.BOOL, True),
       doc="Copy of x where out[index[i][j]][j] combines source[i][j] (dim 0, and so on) by reduce: sum, prod, "
           "mean, amax, amin; without include_self, scattered positions start from the first source value. "
           "Integer mean rounds down.")
define("searchsorted", "sorted values", A("right", T.BOOL, False), A("dtype", T.DTYPE),
       doc="Insertion points of values into sorted along the last dim (sorted 1-d: for all values; else the "
           "leading dims match): first i with sorted[i] >= v (right: > v). NaN sorts last.")
define("nonzero_static", "x", A("size", T.INT), A("fill_value", T.INT, -1),
       doc="[size, x.ndim] int64 coordinates of the nonzero elements in row-major order, cut at size and padded "
           "with fill_value, as torch.nonzero_static.")
define("as_strided", "x", A("size", T.SYMINTS), A("stride", T.SYMINTS), A("offset", T.SYMINT, 0),
       doc="A strided window over x's elements in row-major order: out[i...] = flat(x)[offset + sum(i*stride)]; "
           "strides are >= 0 and the window stays inside x (the kernel checks).")
define("masked_scatter", "x mask source", doc="Copy of x with the positions where mask (broadcast to x) is True "
       "filled, in row-major order, by the leading elements of source.")
define("embedding_bag", "weight indices offsets per_sample_weights?", A("mode", T.STRING, "sum"),
       A("include_last_offset", T.BOOL, False), A("padding_idx", T.INT, -1),
       doc="Bags of rows of weight [V, D]: bag b reduces weight[indices[offsets[b]:offsets[b+1]]] (sum, mean or "
           "max; sum scales each row by per_sample_weights); rows equal to padding_idx (>= 0) are skipped; an "
           "empty bag is zeros. With include_last_offset the last offset ends the last bag.")

# ---- A1: elementwise math, group norm, resampling (upsample, adaptive pooling, grid sample) ----
for _name, _sem in {"acos": "arc cosine", "asin": "arc sine", "atan": "arc tangent", "acosh": "inverse hyperbolic "
                    "cosine", "asinh": "inverse hyperbolic sine", "atanh": "inverse hyperbolic tangent",
                    "cosh": "hyperbolic cosine", "sinh": "hyperbolic sine", "tan": "tangent", "log10": "base-10 log",
                    "log2": "base-2 log", "exp2": "2^x", "erfinv": "inverse error function",
                    "erfc": "complementary error function 1 - erf(x)"}.items():
    define(_name, "x", doc=f"Elementwise {_sem} (floats; NaN outside the domain as PyTorch gives it).")
define("isinf", "x", doc="Elementwise x is +inf or -inf (bool out).")
define("elu", "x", A("alpha", T.FLOAT, 1.0), A("scale", T.FLOAT, 1.0), A("input_scale", T.FLOAT, 1.0),
       doc="scale * x if x > 0 else scale * alpha * (exp(x * input_scale) - 1), as aten.elu (SELU is elu with "
           "its constants).")
define("group_norm", "x weight? bias?", A("groups", T.INT), A("eps", T.FLOAT, 1e-5),
       doc="x [N, C, *] normalized over each group of C/groups channels and all trailing dims (biased variance), "
           "then * weight[C] + bias[C].")
define("upsample", "x", A("size", T.SYMINTS), A("mode", T.STRING, "nearest"), A("align_corners", T.BOOL, False),
       A("scales", T.FLOATS, ()),
       doc="Resize the trailing len(size) dims to size, as aten.upsample_{nearest,linear,bilinear,trilinear}*: "
           "mode 'nearest' (src = floor(dst * scale)) or 'linear' (separable linear interpolation, half-pixel "
           "centers clamped at 0, or corner-aligned when align_corners). scale = 1/scales[i] where the user gave "
           "scale factors, else in/out.")
define("adaptive_pool", "x", A("output_size", T.INTS), A("mode", T.STRING, "avg"),
       doc="Adaptive average ('avg') or max ('max') pooling of the trailing len(output_size) dims: output index o "
           "of an axis of size I pools [floor(o*I/O), ceil((o+1)*I/O)).")
define("grid_sample", "x grid", A("mode", T.STRING, "bilinear"), A("padding_mode", T.STRING, "zeros"),
       A("align_corners", T.BOOL, False),
       doc="As aten.grid_sampler_2d: x [N, C, H, W] sampled at grid [N, Ho, Wo, 2] ((x, y) in [-1, 1]); mode "
           "bilinear or nearest; padding zeros, border or reflection.")
