"""Parakeet TDT (NeMo's FastConformer encoder with a token-and-duration transducer), written here from the NeMo
architecture, loaded from a `.nemo` archive by reading the archive itself (no NeMo install).

The modules carry NeMo's names, so a checkpoint's state dict loads as it is (docs/parakeet-tdt-notes.md lists the
names and where each fact comes from):

  encoder  `pre_encode`: dw_striding subsampling by 8 (a 3x3 stride-2 convolution, then twice a depthwise 3x3
           stride-2 and a pointwise one, ReLU after each stage; the [C, T, F] result flattened channel-major into a
           linear layer), optional x sqrt(d) scaling, then `layers` of Conformer blocks: half feed-forward,
           relative-position self-attention (Transformer-XL: content and position biases per head, the position
           scores shifted into place), convolution module (pointwise + GLU, depthwise, batch norm, SiLU,
           pointwise), half feed-forward, each pre-normed, and a final layer norm.
  decoder  `prediction`: an embedding of the vocabulary plus blank (the last id, a zero row) and an LSTM.
  joint    `enc` and `pred` projections, added, then ReLU and a linear layer to the tokens, the blank and one logit
           per duration.

One utterance at a time, with exactly its valid feature frames (kiln.runtime.audio.nemo_log_mel's first `frames`):
then NeMo's padding masks change nothing, because every position they would mask lies past the end, where the
convolutions' zero padding already is.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import json
import lzma
import math
import os
import reprlib
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import torch
import torch.nn.functional as F
from torch import nn

from kiln.errors import FileFormatError
from kiln.models.state_fit import misfit


class NemoArchiveError(FileFormatError):
    """A .nemo archive kiln cannot use: not a tar, missing or malformed members, or a model other than the Parakeet
    TDT it implements."""


@dataclass(frozen=True)
class ParakeetConfig:
    """The sizes of a Parakeet TDT model, from its model_config.yaml."""

    n_mels: int = 128
    d_model: int = 1024
    n_layers: int = 24
    n_heads: int = 8
    ff_expansion: int = 4
    conv_kernel: int = 9
    subsampling_channels: int = 256
    subsampling_factor: int = 8
    xscaling: bool = True
    use_bias: bool = True
    vocab_size: int = 1024
    pred_hidden: int = 640
    pred_layers: int = 2
    joint_hidden: int = 640
    joint_dropout: float = 0.2
    durations: tuple[int, ...] = (0, 1, 2, 3, 4)
    max_symbols: int = 10
    labels: tuple[str, ...] = field(default=(), compare=False)

    @property
    def blank(self) -> int:
        return self.vocab_size

    @classmethod
    def from_nemo(cls, cfg: dict[str, Any]) -> ParakeetConfig:
        """From a parsed model_config.yaml; what this implementation does not cover is refused, by name, and so is
        a missing or malformed setting, by its key."""
        if not isinstance(cfg, dict):
            raise NemoArchiveError(f"the model config is a {type(cfg).__name__}, not a mapping of settings")
        unsupported = {
            "encoder.subsampling": (_setting(cfg, "encoder.subsampling", str, "dw_striding"), "dw_striding"),
            "encoder.self_attention_model": (_setting(cfg, "encoder.self_attention_model", str, "rel_pos"),
                                             "rel_pos"),
            "encoder.conv_norm_type": (_setting(cfg, "encoder.conv_norm_type", str, "batch_norm"), "batch_norm"),
            "encoder.untie_biases": (_setting(cfg, "encoder.untie_biases", bool, True), True),
            "encoder.causal_downsampling": (_setting(cfg, "encoder.causal_downsampling", bool, False), False),
            "joint.jointnet.activation": (_setting(cfg, "joint.jointnet.activation", str, "relu"), "relu"),
        }
        wrong = {k: v for k, (v, want) in unsupported.items() if v != want}
        if wrong:
            raise NemoArchiveError(f"kiln implements the Parakeet TDT architecture; this model has {wrong}")
        durations = (_setting(cfg, "model_defaults.tdt_durations", list, None)
                     or _setting(cfg, "loss.tdt_kwargs.durations", list, None)
                     or _setting(cfg, "decoding.durations", list, None))
        if not durations:
            raise NemoArchiveError("the model config names no TDT durations (model_defaults.tdt_durations): "
                                   "not a TDT model")
        labels = _setting(cfg, "labels", list, None) or []
        if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= 1000 for d in durations) or \
                not all(isinstance(label, str) for label in labels):
            raise NemoArchiveError(f"the model config's durations must be whole numbers of frames and its labels "
                                   f"strings; found durations {reprlib.repr(durations)}")
        n_mels = _setting(cfg, "encoder.feat_in", int, None) or _setting(cfg, "preprocessor.features", int, 128)
        config = cls(
            n_mels=n_mels, d_model=_setting(cfg, "encoder.d_model", int),
            n_layers=_setting(cfg, "encoder.n_layers", int), n_heads=_setting(cfg, "encoder.n_heads", int),
            ff_expansion=_setting(cfg, "encoder.ff_expansion_factor", int, 4),
            conv_kernel=_setting(cfg, "encoder.conv_kernel_size", int, 31),
            subsampling_channels=_setting(cfg, "encoder.subsampling_conv_channels", int, 256),
            subsampling_factor=_setting(cfg, "encoder.subsampling_factor", int, 8),
            xscaling=_setting(cfg, "encoder.xscaling", bool, True),
            use_bias=_setting(cfg, "encoder.use_bias", bool, True),
            vocab_size=_setting(cfg, "decoder.vocab_size", int),
            pred_hidden=_setting(cfg, "decoder.prednet.pred_hidden", int),
            pred_layers=_setting(cfg, "decoder.prednet.pred_rnn_layers", int, 1),
            joint_hidden=_setting(cfg, "joint.jointnet.joint_hidden", int),
            joint_dropout=_setting(cfg, "joint.jointnet.dropout", float, 0.0),
            durations=tuple(durations),
            max_symbols=_setting(cfg, "decoding.greedy.max_symbols", int, 10) or 10,
            labels=tuple(labels),
        )
        config.check()
        return config

    def check(self) -> None:
        """Refuse sizes that cannot build the model (or would build one far larger than any checkpoint): every
        size positive and bounded, heads dividing d_model, subsampling a power of two."""
        bounds = {"n_mels": 4096, "d_model": 1 << 16, "n_layers": 1024, "n_heads": 1024, "ff_expansion": 64,
                  "conv_kernel": 1024, "subsampling_channels": 1 << 16, "subsampling_factor": 64,
                  "vocab_size": 1 << 20, "pred_hidden": 1 << 16, "pred_layers": 64, "joint_hidden": 1 << 16,
                  "max_symbols": 1000}
        bad = {name: getattr(self, name) for name, most in bounds.items() if not 1 <= getattr(self, name) <= most}
        if bad:
            raise NemoArchiveError(f"the model config has sizes out of range: {bad} (bounds: {bounds})")
        factor = self.subsampling_factor
        if self.d_model % self.n_heads or factor < 2 or factor & (factor - 1):
            raise NemoArchiveError(f"the model config has d_model {self.d_model}, n_heads {self.n_heads} and "
                                   f"subsampling_factor {factor}: heads must divide d_model and the factor be a "
                                   "power of two")
        if not 0.0 <= self.joint_dropout < 1.0:
            raise NemoArchiveError(f"the model config's joint.jointnet.dropout is {self.joint_dropout}")


_MISSING = object()


def _setting(cfg: dict[str, Any], key: str, kind: type, default: Any = _MISSING) -> Any:
    """The model config's value at the dotted `key`, of type `kind` (an int may stand for a float; a whole float
    for an int), `default` when absent (or null); a NemoArchiveError naming the key when it is required and
    absent, or of another type."""
    value: Any = cfg
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        if default is _MISSING:
            raise NemoArchiveError(f"the model config has no {key}")
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise NemoArchiveError(f"the model config's {key} is {reprlib.repr(value)}: a {kind.__name__} expected")
    return value


class ConvSubsampling(nn.Module):
    """dw_striding: [1, T, n_mels] -> [1, T / 8, d_model] (NeMo's `pre_encode`)."""

    def __init__(self, c: ParakeetConfig):
        super().__init__()
        ch = c.subsampling_channels
        stages = int(math.log2(c.subsampling_factor))
        layers: list[nn.Module] = [nn.Conv2d(1, ch, 3, stride=2, padding=1), nn.ReLU()]
        for _ in range(stages - 1):
            layers += [nn.Conv2d(ch, ch, 3, stride=2, padding=1, groups=ch), nn.Conv2d(ch, ch, 1), nn.ReLU()]
        self.conv = nn.Sequential(*layers)
        freq = c.n_mels
        for _ in range(stages):
            freq = (freq - 1) // 2 + 1
        self.out = nn.Linear(ch * freq, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x.unsqueeze(1))  # [B, C, T', F']
        b, ch, t, f = x.shape
        return self.out(x.transpose(1, 2).reshape(b, t, ch * f))


def relative_positions(length: int, d_model: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 2T-1, d] sinusoids of the relative positions T-1 ... -(T-1), sin and cos interleaved (NeMo's
    RelPositionalEncoding, centered on the utterance)."""
    positions = torch.arange(length - 1, -length, -1).to(torch.float32)[:, None]  # integer arange, then cast
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
    angles = positions * inv_freq
    return torch.stack([angles.sin(), angles.cos()], dim=-1).reshape(1, 2 * length - 1, d_model).to(dtype)


class RelPositionAttention(nn.Module):
    def __init__(self, c: ParakeetConfig):
        super().__init__()
        self.heads, self.d_k = c.n_heads, c.d_model // c.n_heads
        for name in ("linear_q", "linear_k", "linear_v", "linear_out"):
            setattr(self, name, nn.Linear(c.d_model, c.d_model, bias=c.use_bias))
        self.linear_pos = nn.Linear(c.d_model, c.d_model, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(self.heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(self.heads, self.d_k))

    def forward(self, x: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.linear_q(x).view(b, t, self.heads, self.d_k)
        k = self.linear_k(x).view(b, t, self.heads, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.heads, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos_emb).view(1, 2 * t - 1, self.heads, self.d_k).transpose(1, 2)  # [1, h, 2T-1, d_k]
        q_u = (q + self.pos_bias_u).transpose(1, 2)
        q_v = (q + self.pos_bias_v).transpose(1, 2)
        bd = q_v @ p.transpose(-1, -2)  # [B, h, T, 2T-1]: query i against relative position T-1-r
        # column j of row i takes relative position i - j, at index T-1-i+j (NeMo's rel_shift; a gather rather
        # than its pad-and-fold, whose reshapes torch.export cannot keep symbolic in T)
        rows, cols = torch.arange(t, device=x.device)[:, None], torch.arange(t, device=x.device)[None, :]
        bd = bd.gather(-1, (t - 1 - rows + cols).expand(b, self.heads, t, t))
        scores = (q_u @ k.transpose(-1, -2) + bd) / math.sqrt(self.d_k)
        out = scores.softmax(dim=-1) @ v
        return self.linear_out(out.transpose(1, 2).reshape(b, t, self.heads * self.d_k))


class FeedForward(nn.Module):
    def __init__(self, c: ParakeetConfig):
        super().__init__()
        self.linear1 = nn.Linear(c.d_model, c.d_model * c.ff_expansion, bias=c.use_bias)
        self.linear2 = nn.Linear(c.d_model * c.ff_expansion, c.d_model, bias=c.use_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.silu(self.linear1(x)))


class ConvolutionModule(nn.Module):
    def __init__(self, c: ParakeetConfig):
        super().__init__()
        d = c.d_model
        self.pointwise_conv1 = nn.Conv1d(d, 2 * d, 1, bias=c.use_bias)
        self.depthwise_conv = nn.Conv1d(d, d, c.conv_kernel, padding=(c.conv_kernel - 1) // 2, groups=d,
                                        bias=c.use_bias)
        self.batch_norm = nn.BatchNorm1d(d)
        self.pointwise_conv2 = nn.Conv1d(d, d, 1, bias=c.use_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.glu(self.pointwise_conv1(x.transpose(1, 2)), dim=1)
        x = F.silu(self.batch_norm(self.depthwise_conv(x)))
        return self.pointwise_conv2(x).transpose(1, 2)


class ConformerLayer(nn.Module):
    def __init__(self, c: ParakeetConfig):
        super().__init__()
        for name in ("norm_feed_forward1", "norm_self_att", "norm_conv", "norm_feed_forward2", "norm_out"):
            setattr(self, name, nn.LayerNorm(c.d_model))
        self.feed_forward1, self.feed_forward2 = FeedForward(c), FeedForward(c)
        self.self_attn = RelPositionAttention(c)
        self.conv = ConvolutionModule(c)

    def forward(self, x: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        x = x + 0.5 * self.feed_forward1(self.norm_feed_forward1(x))
        x = x + self.self_attn(self.norm_self_att(x), pos_emb)
        x = x + self.conv(self.norm_conv(x))
        x = x + 0.5 * self.feed_forward2(self.norm_feed_forward2(x))
        return self.norm_out(x)


class FastConformerEncoder(nn.Module):
    """features [1, n_mels, T] (valid frames only) -> [1, T / 8, d_model]."""

    def __init__(self, c: ParakeetConfig):
        super().__init__()
        self.d_model = c.d_model
        self.scale = math.sqrt(c.d_model) if c.xscaling else 1.0
        self.pre_encode = ConvSubsampling(c)
        self.layers = nn.ModuleList(ConformerLayer(c) for _ in range(c.n_layers))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.pre_encode(features.transpose(1, 2)) * self.scale
        pos_emb = relative_positions(x.shape[1], self.d_model, x.dtype)
        for layer in self.layers:
            x = layer(x, pos_emb)
        return x


class _LSTMHolder(nn.Module):
    def __init__(self, c: ParakeetConfig):
        super().__init__()
        self.lstm = nn.LSTM(c.pred_hidden, c.pred_hidden, num_layers=c.pred_layers)


class PredictionNetwork(nn.Module):
    """NeMo's `decoder.prediction`: the last emitted token (blank = none yet, a zero embedding) through an LSTM."""

    def __init__(self, c: ParakeetConfig):
        super().__init__()
        self.embed = nn.Embedding(c.vocab_size + 1, c.pred_hidden, padding_idx=c.vocab_size)
        self.dec_rnn = _LSTMHolder(c)


class _DecoderHolder(nn.Module):
    def __init__(self, c: ParakeetConfig):
        super().__init__()
        self.prediction = PredictionNetwork(c)


class Joint(nn.Module):
    def __init__(self, c: ParakeetConfig):
        super().__init__()
        self.pred = nn.Linear(c.pred_hidden, c.joint_hidden)
        self.enc = nn.Linear(c.d_model, c.joint_hidden)
        head = nn.Linear(c.joint_hidden, c.vocab_size + 1 + len(c.durations))
        self.joint_net = nn.Sequential(nn.ReLU(), nn.Dropout(c.joint_dropout), head) if c.joint_dropout \
            else nn.Sequential(nn.ReLU(), head)

    def forward(self, f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Logits from the projected encoder frame f and projected prediction g ([..., joint_hidden] each)."""
        return self.joint_net(f + g)


class ParakeetTDT(nn.Module):
    """encoder, decoder.prediction and joint, named as in NeMo's EncDecRNNTBPEModel."""

    def __init__(self, config: ParakeetConfig):
        super().__init__()
        self.config = config
        self.encoder = FastConformerEncoder(config)
        self.decoder = _DecoderHolder(config)
        self.joint = Joint(config)

    def predict(self, token: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(the projected prediction g [1, joint_hidden], the LSTM's next (h, c)) after `token` [1, 1]."""
        prediction = self.decoder.prediction
        out, state = prediction.dec_rnn.lstm(prediction.embed(token).transpose(0, 1), state)
        return self.joint.pred(out[0]), state

    def initial_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        zeros = torch.zeros(c.pred_layers, 1, c.pred_hidden)
        return zeros, zeros.clone()


NEMO_CONFIG, NEMO_WEIGHTS = "model_config.yaml", "model_weights.ckpt"
MAX_CONFIG_BYTES = 16 << 20
"""Largest model_config.yaml read (NeMo's are tens of KB)."""
MIN_MEMBER_LIMIT = 64 << 20
"""Every member may hold this much, or 32 times the archive's size if more (gzip packs float weights by less than
2x; a member that unpacks to far more is a decompression bomb)."""


def read_nemo(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, bytes]]:
    """(the parsed model_config.yaml, the state dict, the other members by name) of a .nemo archive: a tar, plain
    or gzip'd, whose members may sit under './'. The weights are read with torch.load(weights_only=True).

    The archive is untrusted, and nothing of it is ever written to disk: its regular files are read into memory,
    a member named with '..' or an absolute path is refused, links and devices are skipped, and sizes are bounded
    (see MIN_MEMBER_LIMIT)."""
    path = Path(path)
    members = _nemo_members(path)
    for needed in (NEMO_CONFIG, NEMO_WEIGHTS):
        if needed not in members:
            raise NemoArchiveError(f"{path} has no {needed}; its members: {sorted(members)[:20]}")
    config = _nemo_config(members.pop(NEMO_CONFIG), path)
    state = _nemo_weights(members.pop(NEMO_WEIGHTS), path)
    return config, state, members


def _nemo_members(path: Path) -> dict[str, bytes]:
    """The archive's regular files by base name, read into memory; a NemoArchiveError for anything malformed."""
    try:
        budget = max(MIN_MEMBER_LIMIT, 32 * path.stat().st_size)
        members: dict[str, bytes] = {}
        with open(path, "rb") as raw, _decompressed(raw) as stream, \
                tarfile.open(fileobj=_Budget(stream, budget, path), mode="r:") as archive:
            for member in archive:  # (streamed: one header at a time, no list of every member kept)
                name = PurePosixPath(member.name)
                if name.is_absolute() or ".." in name.parts:
                    raise NemoArchiveError(f"{path}: member {member.name!r} points outside the archive; a .nemo "
                                           "archive made by NeMo has none")
                if not member.isfile():  # links, folders, devices: a NeMo archive's members are plain files
                    continue
                if member.size > (MAX_CONFIG_BYTES if name.name == NEMO_CONFIG else budget):
                    raise NemoArchiveError(f"{path}: member {member.name!r} declares {member.size} bytes, more than "
                                           f"kiln reads from an archive of {path.stat().st_size} bytes")
                if name.name in members:
                    raise NemoArchiveError(f"{path}: two members named {name.name!r}")
                members[name.name] = archive.extractfile(member).read()
        return members
    except (NemoArchiveError, FileNotFoundError):
        raise
    except (tarfile.TarError, OSError, EOFError, zlib.error, lzma.LZMAError, UnicodeError) as e:
        raise NemoArchiveError(f"{path} is not a .nemo archive (a tar file), or a damaged one: {e}") from None


def _decompressed(raw: BinaryIO) -> Any:
    """The tar stream inside a plain, gzip'd, bzip2'd or xz'd archive (told apart by their magic bytes)."""
    magic = raw.read(6)
    raw.seek(0)
    if magic.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if magic.startswith(b"BZh"):
        return bz2.BZ2File(raw, "rb")
    if magic.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(raw, "rb")
    return contextlib.nullcontext(raw)


class _Budget:
    """The file object tarfile reads through. tarfile reads what a header declares in one read(n) (a GNU long
    name or a pax header of 8 GB in a 5 KB archive), and a file object allocates n bytes up front; here every read
    is taken in pieces of at most 1 MiB, so memory follows the bytes actually there, and all reads together may not
    pass `budget` (a decompression bomb)."""

    PIECE = 1 << 20

    def __init__(self, stream: Any, budget: int, path: Path):
        self.stream, self.budget, self.path, self.total = stream, budget, path, 0

    def read(self, n: int = -1) -> bytes:
        left = self.budget - self.total + 1 if n is None or n < 0 else n
        pieces = []
        while left > 0:
            piece = self.stream.read(min(left, self.PIECE))
            if not piece:
                break
            pieces.append(piece)
            left -= len(piece)
            self.total += len(piece)
            if self.total > self.budget:
                raise NemoArchiveError(f"{self.path} unpacks to more than {self.budget} bytes: a decompression bomb, "
                                       "or not a .nemo archive")
        return b"".join(pieces)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.stream.seek(offset, whence)

    def tell(self) -> int:
        return self.stream.tell()


def _nemo_config(data: bytes, path: Path) -> dict[str, Any]:
    """The parsed model_config.yaml (safe YAML: plain data, no objects); a mapping, or a NemoArchiveError."""
    import yaml

    try:
        config = yaml.safe_load(data.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise NemoArchiveError(f"{path}: {NEMO_CONFIG} is not valid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise NemoArchiveError(f"{path}: {NEMO_CONFIG} nests too deeply") from None
    if not isinstance(config, dict):
        raise NemoArchiveError(f"{path}: {NEMO_CONFIG} holds a {type(config).__name__}, not a mapping of settings")
    return config


def _nemo_weights(data: bytes, path: Path) -> dict[str, torch.Tensor]:
    """The state dict in model_weights.ckpt, loaded with weights_only=True (tensors and plain containers only, no
    code), and checked to be a mapping of names to tensors."""
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # the unpickler and the zip reader fail in many ways on a damaged file
        cause = " ".join(str(e).split())[:300]  # (torch's messages run over several lines)
        raise NemoArchiveError(f"{path}: {NEMO_WEIGHTS} is not a state dict torch.load(weights_only=True) reads: "
                               f"{type(e).__name__}: {cause}") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise NemoArchiveError(f"{path}: {NEMO_WEIGHTS} holds a {type(state).__name__}, not a mapping of parameter "
                               "names to tensors")
    return state


def load_nemo(path: str | os.PathLike) -> tuple[ParakeetTDT, dict[str, bytes]]:
    """A Parakeet TDT model from a .nemo archive (in eval mode, float32), and the archive's other members (the
    tokenizer's files, named as NeMo stores them: '<hex>_tokenizer.model' and so on).

    The model is first built on the meta device and its parameter shapes compared with the weights', so a config
    that lies about sizes is refused before anything of its size is allocated."""
    config, state, members = read_nemo(path)
    parakeet = ParakeetConfig.from_nemo(config)
    state = {k: v for k, v in state.items() if not k.startswith("preprocessor.")}  # kiln computes the features
    with torch.device("meta"):
        skeleton = ParakeetTDT(parakeet)
    expected = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    problem = misfit(expected, state)
    if problem:
        raise NemoArchiveError(f"{path}: the weights do not fit the Parakeet TDT built from its config: {problem}")
    model = ParakeetTDT(parakeet).eval()
    model.load_state_dict(state)
    return model.float(), members


class _Methods(nn.Module):
    """The three methods a transcription calls: the encoder once per window (its frames already projected for the
    joint, as NeMo's greedy decoding projects them once), the prediction network once per emitted token (its LSTM
    state passed in and out, since a blank must leave it unchanged), and the joint once per decoding step."""

    def __init__(self, model: ParakeetTDT):
        super().__init__()
        self.model = model

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        return self.model.joint.enc(self.model.encoder(features))

    def predict(self, token: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        g, (h, c) = self.model.predict(token, (h, c))
        return g, h, c

    def joint(self, f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return self.model.joint(f, g)


MIN_FRAMES = 16
"""Fewest feature frames `encode` takes (0.16 s; the transcriber pads shorter audio with silence)."""


def export_parakeet(source: ParakeetTDT | str | os.PathLike, max_frames: int = 12000,
                    **export_options: Any) -> Any:
    """A Parakeet TDT program that `kiln transcribe` runs alone, from a model or a .nemo archive: `encode` (feature
    frames [1, n_mels, T], MIN_FRAMES <= T <= max_frames: 12000 is 2 minutes; longer audio is transcribed in windows),
    `predict` and `joint`, and in the metadata the vocabulary, the blank, the durations and max symbols per frame."""
    from kiln.export import Method, export
    from kiln.runtime.speech import info as keys

    model = source if isinstance(source, ParakeetTDT) else load_nemo(source)[0]
    c = model.config
    if len(c.labels) != c.vocab_size:
        raise NemoArchiveError(f"the model config has {len(c.labels)} labels for a vocabulary of {c.vocab_size}: "
                               "kiln needs the labels (the SentencePiece pieces) to write the text")
    # DYNAMIC rather than a named Dim: the encoder's shapes are (frames - 1) // 8 + 1, about which torch.export asks
    # questions (is it 1?) that it cannot answer from a named Dim's range, and refuses; a hint lets it decide them
    frames = torch.export.Dim.DYNAMIC(min=MIN_FRAMES, max=max_frames)
    h, c_state = torch.zeros(c.pred_layers, 1, c.pred_hidden), torch.zeros(c.pred_layers, 1, c.pred_hidden)
    methods = {  # (h and c must be distinct tensors: torch.export takes one tensor passed twice as one input)
        "encode": Method((torch.zeros(1, c.n_mels, 2 * MIN_FRAMES),), dynamic_shapes=({2: frames},)),
        "predict": Method((torch.zeros(1, 1, dtype=torch.long), h, c_state)),
        "joint": Method((torch.zeros(1, c.joint_hidden), torch.zeros(1, c.joint_hidden))),
    }
    metadata = {keys.MODEL_KIND_KEY: "parakeet", keys.N_MELS_KEY: str(c.n_mels),
                keys.LABELS_KEY: json.dumps(list(c.labels)), keys.DURATIONS_KEY: json.dumps(list(c.durations)),
                keys.MAX_SYMBOLS_KEY: str(c.max_symbols), keys.SUBSAMPLING_KEY: str(c.subsampling_factor)}
    if not isinstance(source, ParakeetTDT):
        metadata[keys.NAME_KEY] = Path(source).stem
    metadata.update(export_options.pop("metadata", None) or {})
    return export(_Methods(model).eval(), methods=methods, metadata=metadata, **export_options)


__all__ = ["MIN_FRAMES", "ConformerLayer", "FastConformerEncoder", "NemoArchiveError", "ParakeetConfig", "ParakeetTDT",
           "export_parakeet", "load_nemo", "read_nemo", "relative_positions"]
