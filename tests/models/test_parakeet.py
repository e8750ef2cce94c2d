"""Parakeet TDT: a random-weight .nemo archive built here from parakeet-tdt-0.6b-v2's config scaled down, loaded by
kiln's own reader, and the model written in kiln checked against transformers' independent port (ParakeetForTDT)
with the same weights: encoder states and joint logits."""

from __future__ import annotations

import copy
import io
import tarfile
from pathlib import Path

import pytest
import torch
import yaml

from kiln.models.parakeet import NemoArchiveError, ParakeetConfig, ParakeetTDT, load_nemo

V2_CONFIG = {  # parakeet-tdt-0.6b-v2's model_config.yaml keys (docs/parakeet-tdt-notes.md), sizes scaled down
    "sample_rate": 16000,
    "labels": [f"tok{i}" for i in range(40)],
    "preprocessor": {"_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
                     "sample_rate": 16000, "normalize": "per_feature", "window_size": 0.025, "window_stride": 0.01,
                     "window": "hann", "features": 128, "n_fft": 512, "log": True, "frame_splicing": 1,
                     "dither": 1.0e-05, "pad_to": 0, "pad_value": 0.0},
    "encoder": {"_target_": "nemo.collections.asr.modules.ConformerEncoder", "feat_in": 128, "feat_out": -1,
                "n_layers": 2, "d_model": 64, "use_bias": False, "subsampling": "dw_striding",
                "subsampling_factor": 8, "subsampling_conv_channels": 16, "causal_downsampling": False,
                "ff_expansion_factor": 4, "self_attention_model": "rel_pos", "n_heads": 4,
                "att_context_size": [-1, -1], "xscaling": False, "untie_biases": True, "pos_emb_max_len": 5000,
                "conv_kernel_size": 9, "conv_norm_type": "batch_norm", "dropout": 0.1, "dropout_att": 0.1},
    "decoder": {"_target_": "nemo.collections.asr.modules.RNNTDecoder", "blank_as_pad": True, "vocab_size": 40,
                "prednet": {"pred_hidden": 32, "pred_rnn_layers": 2, "dropout": 0.2}},
    "joint": {"_target_": "nemo.collections.asr.modules.RNNTJoint", "num_classes": 40, "num_extra_outputs": 5,
              "jointnet": {"joint_hidden": 32, "activation": "relu", "dropout": 0.2, "encoder_hidden": 64,
                           "pred_hidden": 32}},
    "model_defaults": {"enc_hidden": 64, "pred_hidden": 32, "joint_hidden": 32, "tdt_durations": [0, 1, 2, 3, 4],
                       "num_tdt_durations": 5},
    "decoding": {"strategy": "greedy_batch", "model_type": "tdt", "durations": [0, 1, 2, 3, 4],
                 "greedy": {"max_symbols": 10}},
}


def random_parakeet(config: dict, seed: int = 0) -> ParakeetTDT:
    """Random weights everywhere, batch norm statistics included (so folding them is exercised)."""
    torch.manual_seed(seed)
    model = ParakeetTDT(ParakeetConfig.from_nemo(config)).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("running_var"):
                tensor.copy_(torch.rand_like(tensor) + 0.5)
            elif tensor.is_floating_point() and "embed" not in name:
                tensor.copy_(torch.randn_like(tensor) * 0.3)
    return model


def write_nemo(model: ParakeetTDT, config: dict, path: Path, gzip: bool = False) -> Path:
    """A .nemo archive as NeMo's save_to writes one: a tar of ./model_config.yaml, ./model_weights.ckpt (the state
    dict, preprocessor buffers included) and the tokenizer under a hex-prefixed name."""
    state = dict(model.state_dict())
    state["preprocessor.featurizer.window"] = torch.hann_window(400, periodic=False)
    state["preprocessor.featurizer.fb"] = torch.zeros(1, config["preprocessor"]["features"], 257)
    weights = io.BytesIO()
    torch.save(state, weights)
    members = {"./model_config.yaml": yaml.safe_dump(config).encode(), "./model_weights.ckpt": weights.getvalue(),
               "./3f2ae1_tokenizer.model": b"sentencepiece model bytes"}
    with tarfile.open(path, "w:gz" if gzip else "w:") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("gzip", [False, True], ids=["tar", "tar.gz"])
def test_nemo_archive_loads_every_weight(tmp_path, gzip):
    model = random_parakeet(V2_CONFIG)
    loaded, members = load_nemo(write_nemo(model, V2_CONFIG, tmp_path / "m.nemo", gzip))
    assert list(members) == ["3f2ae1_tokenizer.model"]
    assert loaded.config.blank == 40 and loaded.config.durations == (0, 1, 2, 3, 4) and not loaded.config.xscaling
    want = model.state_dict()
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=0, msg=name)


def test_what_is_not_a_parakeet_tdt_is_refused(tmp_path):
    (tmp_path / "x.nemo").write_bytes(b"not a tar")
    with pytest.raises(NemoArchiveError, match="not a .nemo archive"):
        load_nemo(tmp_path / "x.nemo")
    ctc = copy.deepcopy(V2_CONFIG)
    ctc["encoder"]["self_attention_model"] = "abs_pos"
    with pytest.raises(NemoArchiveError, match="self_attention_model"):
        load_nemo(write_nemo(random_parakeet(V2_CONFIG), ctc, tmp_path / "ctc.nemo"))
    no_tdt = copy.deepcopy(V2_CONFIG)
    del no_tdt["model_defaults"], no_tdt["decoding"]["durations"]
    with pytest.raises(NemoArchiveError, match="TDT durations"):
        load_nemo(write_nemo(random_parakeet(V2_CONFIG), no_tdt, tmp_path / "rnnt.nemo"))


HF_NAMES = (  # NeMo -> transformers names (transformers' convert_nemo_to_hf.py, as the notes record it)
    ("encoder.pre_encode.conv.", "encoder.subsampling.layers."),
    ("encoder.pre_encode.out.", "encoder.subsampling.linear."),
    (".self_attn.linear_q.", ".self_attn.q_proj."), (".self_attn.linear_k.", ".self_attn.k_proj."),
    (".self_attn.linear_v.", ".self_attn.v_proj."), (".self_attn.linear_out.", ".self_attn.o_proj."),
    (".self_attn.linear_pos.", ".self_attn.relative_k_proj."), (".self_attn.pos_bias_u", ".self_attn.bias_u"),
    (".self_attn.pos_bias_v", ".self_attn.bias_v"), (".conv.batch_norm.", ".conv.norm."),
    ("decoder.prediction.embed.", "decoder.embedding."), ("decoder.prediction.dec_rnn.lstm.", "decoder.lstm."),
    ("joint.pred.", "decoder.decoder_projector."), ("joint.enc.", "encoder_projector."),
    ("joint.joint_net.2.", "joint.head."),
)


def transformers_twin(model: ParakeetTDT):
    """transformers' ParakeetForTDT with `model`'s weights."""
    parakeet = pytest.importorskip("transformers.models.parakeet")
    c = model.config
    encoder = parakeet.ParakeetEncoderConfig(
        hidden_size=c.d_model, num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        intermediate_size=c.d_model * c.ff_expansion, attention_bias=c.use_bias, convolution_bias=c.use_bias,
        conv_kernel_size=c.conv_kernel, subsampling_factor=c.subsampling_factor,
        subsampling_conv_channels=c.subsampling_channels, num_mel_bins=c.n_mels, scale_input=c.xscaling)
    config = parakeet.ParakeetTDTConfig(vocab_size=c.vocab_size + 1, blank_token_id=c.blank, pad_token_id=0,
                                        decoder_hidden_size=c.pred_hidden, num_decoder_layers=c.pred_layers,
                                        durations=list(c.durations), encoder_config=encoder)
    twin = parakeet.ParakeetForTDT(config).eval()
    state = {}
    for name, value in model.state_dict().items():
        for ours, theirs in HF_NAMES:
            name = name.replace(ours, theirs)
        state[name] = value
    missing, unexpected = twin.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "num_batches" not in m], (missing, unexpected)
    return twin


@pytest.mark.parametrize("xscaling", [False, True])
def test_encoder_and_joint_match_transformers(xscaling):
    config = copy.deepcopy(V2_CONFIG)
    config["encoder"]["xscaling"] = xscaling
    model = random_parakeet(config, seed=int(xscaling))
    twin = transformers_twin(model)
    features = torch.randn(1, 128, 203)  # 203 frames -> 26 encoder frames
    with torch.no_grad():
        ours = model.encoder(features)
        theirs = twin.encoder(input_features=features.transpose(1, 2)).last_hidden_state
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        assert ours.shape == (1, 26, 64)
        g, state = model.predict(torch.tensor([[7]]), model.initial_state())
        g2, _ = model.predict(torch.tensor([[3]]), state)
        f = model.joint.enc(ours[0, :4])
        logits = model.joint(f, g2)
        their_g = twin.decoder(torch.tensor([[7, 3]]))[:, -1]
        their_logits = twin.joint(their_g, twin.encoder_projector(theirs[0, :4]))
        torch.testing.assert_close(logits, their_logits, rtol=1e-4, atol=1e-4)
        assert logits.shape == (4, 40 + 1 + 5)


def eager_tdt(model: ParakeetTDT, features: torch.Tensor) -> list[int]:
    """Greedy TDT decoding written out plainly over the PyTorch model, NeMo's greedy_batch rules: a blank moves on
    by at least one frame and leaves the prediction network alone; a token is fed to it and moves on by its
    duration; after max_symbols tokens on one frame, decoding moves on."""
    c = model.config
    with torch.no_grad():
        f = model.joint.enc(model.encoder(features))[0]
        g, state = model.predict(torch.tensor([[c.blank]]), model.initial_state())
        out, t, last_frame, on_frame = [], 0, -1, 0
        while t < f.shape[0]:
            frame = t
            logits = model.joint(f[t], g[0])
            label, duration = int(logits[:c.blank + 1].argmax()), c.durations[int(logits[c.blank + 1:].argmax())]
            if label == c.blank:
                t += max(duration, 1)
                continue
            out.append(label)
            g, state = model.predict(torch.tensor([[label]]), state)
            t += duration
            on_frame = on_frame + 1 if frame == last_frame else 1
            last_frame = frame
            if on_frame >= c.max_symbols and t == frame:
                t += 1
    return out


def test_exported_methods_equal_the_eager_model(backend):
    """encode at three lengths (the frame count is dynamic; batch norm folded into the depthwise convolution), a
    predict step from a non-zero LSTM state, and the joint, on every backend."""
    import numpy as np

    from kiln.models.parakeet import export_parakeet
    from tests.conftest import to_numpy

    model = random_parakeet(V2_CONFIG, seed=5)
    program = export_parakeet(model).load()
    assert "batch_norm" not in {n.op for n in program.ir.methods["encode"].nodes}
    session, rng = program.session(backend), np.random.default_rng(0)
    for frames in (16, 203, 997):
        x = rng.standard_normal((1, 128, frames)).astype(np.float32)
        with torch.no_grad():
            want = model.joint.enc(model.encoder(torch.from_numpy(x))).numpy()
        np.testing.assert_allclose(to_numpy(session.run("encode", x)[0]), want, rtol=1e-4, atol=1e-4)
    h, c = (rng.standard_normal((2, 1, 32)).astype(np.float32) for _ in range(2))
    g, h2, c2 = session.run("predict", np.array([[28]]), h, c)
    with torch.no_grad():
        g_want, (h_want, c_want) = model.predict(torch.tensor([[28]]), (torch.from_numpy(h), torch.from_numpy(c)))
        f = torch.from_numpy(rng.standard_normal((1, 32)).astype(np.float32))
        logits_want = model.joint(f, g_want).numpy()
    for got, want in ((g, g_want), (h2, h_want), (c2, c_want)):
        np.testing.assert_allclose(to_numpy(got), want.numpy(), rtol=1e-5, atol=1e-5)
    joint = to_numpy(session.run("joint", f.numpy(), g)[0])
    np.testing.assert_allclose(joint, logits_want, rtol=1e-5, atol=1e-5)


def test_exported_transcription_equals_the_eager_greedy_loop(tmp_path):
    from kiln.models.parakeet import export_parakeet
    from kiln.runtime.audio import nemo_log_mel, read_wav
    from kiln.runtime.speech import ParakeetTranscriber, transcriber
    from tests.runtime.test_audio import beckett_path

    model = random_parakeet(V2_CONFIG, seed=3)
    path = export_parakeet(write_nemo(model, V2_CONFIG, tmp_path / "m.nemo")).save(tmp_path / "p.kiln")
    samples = read_wav(beckett_path()).samples
    result = transcriber(path).transcribe(samples)
    features, frames = nemo_log_mel(samples, 128)
    want = eager_tdt(model, torch.from_numpy(features[None, :, :frames]))
    assert result.token_ids == [want] and len(want) > 10
    assert result.text == "".join(f"tok{t}" for t in want)
    short = ParakeetTranscriber(path).transcribe(samples[:800])  # 50 ms: padded to the encoder's shortest input
    assert len(short.windows) == 1


def test_parakeet_commands(tmp_path):
    from tests.runtime.test_audio import beckett_path
    from tests.test_cli import cli

    nemo = write_nemo(random_parakeet(V2_CONFIG, seed=4), V2_CONFIG, tmp_path / "m.nemo")
    code, out, err = cli("export-parakeet", nemo, "-o", tmp_path / "p.kiln", "--max-seconds", "4")
    assert code == 0, err
    assert "methods: encode" in out
    code, out, err = cli("transcribe", tmp_path / "p.kiln", beckett_path())
    assert code == 0, err
    assert "window 3/3" in err and "real-time factor" in err and out.strip().startswith("tok")
    code, _, err = cli("transcribe", tmp_path / "p.kiln", beckett_path(), "--language", "de")
    assert code == 2 and "Whisper and Voxtral programs only" in err
    code, _, err = cli("export-parakeet", tmp_path / "missing.nemo", "-o", tmp_path / "x.kiln")
    assert code == 2 and "not a file" in err
