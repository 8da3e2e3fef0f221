"""``blazecore train`` (blazecore_app.train) on the CPU: the loss falls, a resumed run continues
exactly, and the conventional PyTorch MoE (``--baseline``) trains the same model to the same losses.

Tiny models on blazecore's CPU reference path; every run takes well under a second per step.
"""

from __future__ import annotations

import io
import json
import pathlib

import pytest

torch = pytest.importorskip("torch")

_ROOT = pathlib.Path(__file__).resolve().parents[1]

from blazecore_app import baselines as baseline  # noqa: E402
from blazecore_app import train  # noqa: E402
from blazecore_app.corpus import SyntheticLanguage  # noqa: E402
from blazecore_torch import MoELayer  # noqa: E402

TINY = {"steps": 6, "batch": 8, "seq_len": 16, "d_model": 32, "n_heads": 2, "n_layers": 2, "num_experts": 4,
        "top_k": 2, "expert_hidden": 32, "corpus_tokens": 20_000, "eval_batches": 1, "sample_tokens": 0, "warmup": 2,
        "lr": 1e-2, "device": "cpu"}


def _run(**options):
    return train.run({**TINY, **options}, out=io.StringIO(), err=io.StringIO())


def _losses(doc):
    return [h["loss"] for h in doc["history"]]


def test_corpus_is_deterministic_and_prefix_stable():
    lang = SyntheticLanguage()
    a, b = lang.generate(3000), SyntheticLanguage().generate(5000)
    assert (a == b[:3000]).all()
    assert lang.vocab[0] == "<eos>" and len(set(lang.vocab)) == lang.vocab_size
    assert "count :" in lang.decode(b) and "repeats :" in lang.decode(b)


def test_loss_decreases(tmp_path):
    doc = _run(steps=30, batch=16, warmup=3, lr=3e-2, log=str(tmp_path / "log.json"))
    s = doc["summary"]
    assert s["first_loss"] > 5.0  # ln(186): the untrained model is uniform over the words
    assert s["final_loss"] < s["first_loss"] - 0.3, _losses(doc)  # measured: 5.23 -> 4.76
    assert s["val_final"] < s["val_first"] - 0.4  # measured: 5.24 -> 4.58
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["status"] == "done" and [h["step"] for h in log["history"]] == list(range(1, 31))
    assert log["impl"] == "blazecore" and log["summary"]["memory_kind"] == "peak process RSS"


def test_resume_continues_exactly(tmp_path):
    whole = _run()
    part = _run(ckpt_dir=str(tmp_path), stop_at=3)
    assert part["status"] == "stopped" and len(part["history"]) == 3
    assert (tmp_path / train.CHECKPOINT_FILE).exists()
    rest = _run(ckpt_dir=str(tmp_path), resume=True)
    assert rest["status"] == "done" and rest["summary"]["resumed_from"] == 3
    assert _losses(rest) == _losses(whole)  # the same bits, steps 1-3 from the checkpoint, 4-6 recomputed
    assert rest["val"][-1] == whole["val"][-1]
    assert rest["init_sha256"] == whole["init_sha256"]


def test_resume_rejects_another_model(tmp_path):
    _run(ckpt_dir=str(tmp_path), stop_at=1)
    with pytest.raises(train.ConfigError, match="d_model"):
        _run(ckpt_dir=str(tmp_path), resume=True, d_model=64)


@pytest.mark.parametrize("dtype,rtol", [("float64", 1e-9), ("float32", 1e-4)], ids=["float64", "float32"])
def test_baseline_matches_blazecore(dtype, rtol):
    """Same seed: same initial weights and batches; the two MoE implementations give the same losses."""
    ours = _run(dtype=dtype, steps=4)
    base = _run(dtype=dtype, steps=4, impl="conventional")
    assert ours["init_sha256"] == base["init_sha256"]
    assert base["impl"] == "conventional"
    for step, (a, b) in enumerate(zip(_losses(ours), _losses(base), strict=True), 1):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: blazecore {a} vs baseline {b}"


def test_gpt_oss_storage_trains_as_the_baseline(tmp_path):
    """gpt-oss's experts (--weight-layout in_out --ffn-bias --activation swiglu_oai_interleaved): blazecore and the
    conventional baseline start from the same weights and give the same losses (float64); the model's expert
    parameters are stored so; a checkpoint written before these fields existed resumes as one with their
    defaults."""
    gpt = {"weight_layout": "in_out", "ffn_bias": True, "activation": "swiglu_oai_interleaved", "dtype": "float64",
           "steps": 3}
    ours = _run(**gpt)
    base = _run(**gpt, impl="conventional")
    assert ours["init_sha256"] == base["init_sha256"] != _run(dtype="float64", steps=3)["init_sha256"]
    for step, (a, b) in enumerate(zip(_losses(ours), _losses(base), strict=True), 1):
        assert abs(a - b) <= 1e-9 * abs(b), f"step {step}: blazecore {a} vs baseline {b}"
    cfg = train.make_config({**TINY, **gpt}, torch.device("cpu"))
    moe = train.MoETransformer(cfg, 186).blocks[0].moe
    assert moe.gate_up_proj.shape == (4, 32, 64) and moe.down_proj.shape == (4, 32, 32)
    assert moe.gate_up_proj_bias.shape == (4, 64) and moe.down_proj_bias.shape == (4, 32)
    # an older checkpoint (no weight_layout / ffn_bias in its configuration) resumes with their defaults
    whole = _run(steps=3)
    _run(steps=3, ckpt_dir=str(tmp_path), stop_at=1)
    path = tmp_path / train.CHECKPOINT_FILE
    ckpt = torch.load(path, weights_only=False)
    for k in ("weight_layout", "ffn_bias"):
        del ckpt["config"][k]
    torch.save(ckpt, path)
    assert _losses(_run(steps=3, ckpt_dir=str(tmp_path), resume=True)) == _losses(whole)
    with pytest.raises(train.ConfigError, match="weight_layout out_in"):
        _run(steps=3, ckpt_dir=str(tmp_path), resume=True, weight_layout="in_out")
    with pytest.raises(train.ConfigError, match="weight_layout must be one of"):
        _run(weight_layout="transposed")


@pytest.mark.parametrize("weight_layout,bias", [("out_in", False), ("in_out", True)], ids=("plain", "gpt_oss"))
def test_baseline_layer_is_a_drop_in(weight_layout, bias):
    """BaselineMoELayer takes MoELayer's state dict and computes the same y and auxiliary losses (float64)."""
    torch.manual_seed(0)
    kw = {"weight_layout": weight_layout, "bias": bias}
    ours = MoELayer(16, 8, 4, 2, dtype=torch.float64, **kw)
    base = baseline.BaselineMoELayer(16, 8, 4, 2, dtype=torch.float64, **kw)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in base.state_dict().items()}
    base.load_state_dict(ours.state_dict())
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    y, aux = ours(x)
    yb, auxb = base(x)
    torch.testing.assert_close(yb, y, rtol=1e-10, atol=1e-12)
    for key in ("load_balancing_loss", "z_loss"):
        torch.testing.assert_close(auxb[key], aux[key].to(auxb[key].dtype), rtol=1e-10, atol=1e-12)
    assert torch.equal(auxb["tokens_per_expert"], aux["tokens_per_expert"].to(torch.int32))


def test_compare_script_fails_on_disagreement():
    """scripts/gpu_train_compare.py's verdict: diverging curves or higher memory fail; agreeing runs pass."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_train_compare", _ROOT / "scripts" / "gpu_train_compare.py")
    cmp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cmp)

    def log(impl, losses, peak):
        return {"impl": impl, "device": "cuda:0", "device_name": "GPU", "init_sha256": "x",
                "config": {"impl": impl, "steps": len(losses), "seed": 0},
                "history": [{"step": i + 1, "lm_loss": v} for i, v in enumerate(losses)],
                "summary": {"peak_memory_bytes": peak, "tokens_per_s": 1000.0, "val_final": losses[-1]}}

    curve = [5.0 * 0.98**i for i in range(100)]
    good = cmp.compare(log("blazecore", curve, 1 << 30), log("conventional", [v * 1.001 for v in curve], 2 << 30))
    assert good["ok"], good["failed"]
    apart = cmp.compare(log("blazecore", [v * 1.2 for v in curve], 1 << 30), log("conventional", curve, 2 << 30))
    assert not apart["ok"] and "curves" in apart["failed"]
    heavier = cmp.compare(log("blazecore", curve, 3 << 30), log("conventional", curve, 2 << 30))
    assert heavier["failed"] == ["memory"]
    on_cpu = log("blazecore", curve, 1 << 30)
    on_cpu["device"] = "cpu"
    assert "on a GPU" in cmp.compare(on_cpu, log("conventional", curve, 2 << 30))["failed"]
