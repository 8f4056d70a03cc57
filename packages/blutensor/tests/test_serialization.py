"""blutensor.save / load: safetensors files, round trips of every dtype and of nested state (optimizer,
scheduler, generator), interchange with other safetensors readers, and errors raised before writing."""

from __future__ import annotations

import io

import blutensor as bt
import numpy as np
import pytest
from conftest import host


def test_state_dict_round_trip_every_dtype(tmp_path, device):
    sd = {"f32": bt.randn(3, 4), "f64": bt.randn(2, dtype=bt.float64), "bf16": bt.randn(5).to(bt.bfloat16),
          "f16": bt.randn(2).to(bt.float16), "i64": bt.arange(4), "i32": bt.arange(3, dtype=bt.int32),
          "u16": bt.arange(3, dtype=bt.uint16), "b": bt.tensor([True, False]), "empty": bt.zeros(0, 3),
          "scalar": bt.tensor(2.5), "view": bt.arange(12).view(3, 4).T}
    sd = {k: v.to(device) for k, v in sd.items()}
    path = tmp_path / "m.safetensors"
    bt.save(sd, path)
    back = bt.load(path)
    assert list(back) == list(sd)
    assert set(_names(path)) == set(sd)  # an ordinary safetensors file: other readers see the names
    for k, v in sd.items():
        assert back[k].dtype is v.dtype and back[k].shape == v.shape and back[k].device == v.device, k
        np.testing.assert_array_equal(np.asarray(back[k].numpy(), dtype=np.float64),
                                      np.asarray(v.numpy(), dtype=np.float64), err_msg=k)

    assert not list(tmp_path.glob("*.tmp*"))
    on_cpu = bt.load(path, map_location="cpu")
    assert all(v.device == bt.device("cpu") for v in on_cpu.values())


def _names(path):
    import safetensors

    with safetensors.safe_open(str(path), "numpy") as f:
        return list(f.keys())


def test_nested_checkpoint_round_trip():
    p = bt.nn.Parameter(bt.randn(3))
    opt = bt.optim.AdamW([p], lr=0.1, betas=(0.8, 0.9))
    sched = bt.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    p.grad = bt.ones(3)
    opt.step()
    sched.step()
    ckpt = {"model": {"w": p.detach()}, "opt": opt.state_dict(), "sched": sched.state_dict(), "step": 7,
            "rng": bt.get_rng_state(), "cfg": {"dtype": bt.bfloat16, "device": bt.device("cpu"), "ratio": 0.5,
                                               "none": None, "inf": float("inf"), "names": ("a", "b")}}
    buf = io.BytesIO()
    bt.save(ckpt, buf)
    buf.seek(0)
    back = bt.load(buf)
    assert back["step"] == 7 and back["rng"] == bt.get_rng_state()
    assert back["cfg"] == ckpt["cfg"]
    st = back["opt"]["state"]
    assert list(st) == [0] and st[0]["step"] == 1  # int keys and plain values keep their types
    np.testing.assert_array_equal(host(st[0]["exp_avg"]), host(opt.state[p]["exp_avg"]))
    assert back["opt"]["param_groups"][0]["betas"] == (0.8, 0.9)
    assert back["sched"]["last_epoch"] == 1
    opt2 = bt.optim.AdamW([bt.nn.Parameter(bt.randn(3))], lr=0.1)
    opt2.load_state_dict(back["opt"])


def test_foreign_safetensors_file_and_map_location(tmp_path):
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "t.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(2, dtype=torch.bfloat16)},
              str(path))
    back = bt.load(path, map_location="cpu")
    np.testing.assert_array_equal(host(back["a"]), np.arange(6).reshape(2, 3))
    assert back["b"].dtype is bt.bfloat16


def test_errors_before_writing(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(bt.DTypeError, match=r"obj\['model'\]\['w'\] is a numpy.ndarray"):
        bt.save({"model": {"w": np.zeros(3)}}, path)
    with pytest.raises(bt.DTypeError, match="is a blutensor.nn.layers.Linear.*state_dict"):
        bt.save(bt.nn.Linear(2, 2), path)
    with pytest.raises(bt.DTypeError, match="has a key of type tuple"):
        bt.save({(1, 2): 3}, path)
    assert not path.exists()
    (tmp_path / "junk").write_bytes(b"not a checkpoint")
    with pytest.raises(bt.BluTensorError, match="is not a safetensors file"):
        bt.load(tmp_path / "junk")
