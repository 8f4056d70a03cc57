"""blublas.settings: the BLUBLAS_* variables are read once, validated by name, and read again only on reset."""

from pathlib import Path

import pytest
from blublas import GemmError, autotune, configs, settings, split_tf32
from blublas.settings import ENV, Settings


def test_defaults_and_every_variable_parsed():
    assert Settings.from_env({}) == Settings()
    s = Settings.from_env({"BLUBLAS_WGMMA": "On", "BLUBLAS_WGMMA_PROBE": "inproc", "BLUBLAS_SELFTEST_TIMEOUT": "2.5",
                           "BLUBLAS_WGMMA_TMA_STORE": "0", "BLUBLAS_WGMMA_DEBUG_NO_EPILOGUE": "1",
                           "BLUBLAS_AUTOTUNE": "true", "BLUBLAS_3XTF32": "concat", "BLUBLAS_3XTF32_MAX_TEMP_MB": "7",
                           "BLUBLAS_LAUNCH_MEMO": "off", "BLUBLAS_CUBLASLT_TUNE": "no",
                           "BLUBLAS_CUBLASLT": "/opt/libcublasLt.so.12", "BLUBLAS_CACHE_DIR": "/tmp/bb"})
    assert s == Settings(wgmma="on", wgmma_probe="inproc", selftest_timeout=2.5, wgmma_tma_store=False,
                         debug_no_epilogue=True, autotune=True, split_3xtf32="concat", max_3xtf32_temp_mb=7,
                         launch_memo=False, cublaslt_tune=False, cublaslt="/opt/libcublasLt.so.12",
                         cache_dir=Path("/tmp/bb"))
    assert s.max_3xtf32_temp_bytes == 7 << 20
    assert Settings.from_env({"BLUBLAS_WGMMA": "0"}).wgmma == "off"
    assert Settings.from_env({"BLUBLAS_WGMMA": " ", "BLUBLAS_AUTOTUNE": ""}) == Settings()  # empty: the default
    assert set(ENV) == {f for f in Settings.__dataclass_fields__}


@pytest.mark.parametrize("var,value,says", [
    ("BLUBLAS_WGMMA", "maybe", "auto, 1 (on) or 0 (off)"),
    ("BLUBLAS_WGMMA_PROBE", "thread", "subprocess, inproc"),
    ("BLUBLAS_SELFTEST_TIMEOUT", "soon", "number of seconds"),
    ("BLUBLAS_SELFTEST_TIMEOUT", "-1", "> 0"),
    ("BLUBLAS_SELFTEST_TIMEOUT", "nan", "> 0"),
    ("BLUBLAS_WGMMA_TMA_STORE", "2", "1 or 0"),
    ("BLUBLAS_WGMMA_DEBUG_NO_EPILOGUE", "y", "1 or 0"),
    ("BLUBLAS_AUTOTUNE", "False!", "1 or 0"),
    ("BLUBLAS_3XTF32", "three", "two, concat"),
    ("BLUBLAS_3XTF32_MAX_TEMP_MB", "1.5", "integer number of MiB"),
    ("BLUBLAS_LAUNCH_MEMO", "maybe", "1 or 0"),
    ("BLUBLAS_CUBLASLT_TUNE", "fast", "1 or 0"),
])
def test_bad_value_is_an_error_naming_the_variable_at_first_use(monkeypatch, var, value, says):
    monkeypatch.setenv(var, value)
    with pytest.raises(GemmError, match=var) as e:
        settings.get()
    assert says in str(e.value) and repr(value) in str(e.value)
    with pytest.raises(GemmError, match=var):  # still refused (nothing half-read was kept)
        configs.wgmma_mode()
    monkeypatch.delenv(var)
    settings.reset()
    assert settings.get() == Settings()


def test_constructor_refuses_bad_fields():
    with pytest.raises(GemmError, match="wgmma must be one of"):
        Settings(wgmma="1")
    with pytest.raises(GemmError, match="autotune must be True or False"):
        Settings(autotune=1)
    with pytest.raises(GemmError, match="max_3xtf32_temp_mb"):
        Settings(max_3xtf32_temp_mb=0)


def test_env_change_after_first_read_has_no_effect_until_reset(monkeypatch, tmp_path):
    for var in ENV.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("BLUBLAS_CACHE_DIR", str(tmp_path / "a"))
    first = settings.get()
    assert settings.get() is first  # one object, not re-read per call
    assert (configs.wgmma_mode(), split_tf32.mode(), split_tf32.max_temp_bytes()) == ("auto", "two", 1024 << 20)
    assert autotune.default_cache().path == tmp_path / "a" / "autotune.json"
    monkeypatch.setenv("BLUBLAS_WGMMA", "0")
    monkeypatch.setenv("BLUBLAS_3XTF32", "concat")
    monkeypatch.setenv("BLUBLAS_3XTF32_MAX_TEMP_MB", "2")
    monkeypatch.setenv("BLUBLAS_CACHE_DIR", str(tmp_path / "b"))
    monkeypatch.setenv("BLUBLAS_AUTOTUNE", "bogus")  # not even validated until read again
    assert settings.get() is first
    assert (configs.wgmma_mode(), split_tf32.mode(), split_tf32.max_temp_bytes()) == ("auto", "two", 1024 << 20)
    assert configs.variants_for("bf16", 90) == ["bf16", "wgmma"]
    assert autotune.default_cache().path == tmp_path / "a" / "autotune.json"
    settings.reset()
    with pytest.raises(GemmError, match="BLUBLAS_AUTOTUNE"):
        settings.get()
    monkeypatch.setenv("BLUBLAS_AUTOTUNE", "1")
    settings.reset()
    assert (configs.wgmma_mode(), split_tf32.mode(), split_tf32.max_temp_bytes()) == ("off", "concat", 2 << 20)
    assert configs.variants_for("bf16", 90) == ["bf16"]
    assert settings.get().autotune is True
    assert autotune.default_cache().path == tmp_path / "b" / "autotune.json"


def test_blublas_reads_no_environment_variable_outside_settings():
    """Every BLUBLAS_* read goes through blublas.settings (os.environ is read on a call nowhere else)."""
    import re

    src = Path(settings.__file__).parent
    for f in sorted(src.glob("*.py")):
        if f.name == "settings.py":
            continue
        text = f.read_text()
        assert not re.search(r"environ(\.get)?\(?\[?[\"']BLUBLAS_", text), f.name
        assert not re.search(r"getenv\([\"']BLUBLAS_", text), f.name


def test_a_bad_switch_fails_the_first_gemm_even_on_the_cpu(monkeypatch):
    import numpy as np
    from blublas import gemm

    a = np.ones((2, 3), np.float32)
    monkeypatch.setenv("BLUBLAS_WGMMA", "maybe")
    with pytest.raises(GemmError, match="BLUBLAS_WGMMA must be auto, 1 \\(on\\) or 0 \\(off\\), got 'maybe'"):
        gemm(a, a, trans_b=True)
    monkeypatch.delenv("BLUBLAS_WGMMA")
    settings.reset()
    np.testing.assert_allclose(gemm(a, a, trans_b=True), np.full((2, 2), 3.0))
