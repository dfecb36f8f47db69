"""The kernels' launch tunings follow the card's SM count (``kernels.device``)."""

import types

import jax
import pytest

from jfp8kv.config import CacheConfig
from jfp8kv.kernels import device, mosaic_mla, pallas_decode


def _cfg(storage):
    scale = "token" if storage.startswith("float8") else None
    return CacheConfig(num_layers=2, num_kv_heads=8, head_dim=128, num_pages=4, page_size=16,
                       storage_dtype=storage, scale_mode=scale)


@pytest.fixture
def sms(monkeypatch):
    """Pretend the first GPU reports ``n`` SMs (None: no GPU at all)."""
    def set_(n):
        device.num_sms.cache_clear()

        def devices(kind=None):
            if n is None:
                raise RuntimeError("no gpu")
            return [types.SimpleNamespace(core_count=n, platform="gpu")]
        monkeypatch.setattr(device.jax, "devices", devices)
    yield set_
    device.num_sms.cache_clear()


def test_no_gpu_keeps_the_reference_card(sms):
    sms(None)
    assert device.num_sms() == device.REFERENCE_SMS == 132
    t = pallas_decode.default_tuning(_cfg("bfloat16"))
    assert t.target_programs == 528 and t.unsplit_programs == (198, 396)
    assert mosaic_mla.MosaicMLATuning().target_programs == 128


@pytest.mark.parametrize("n", [114, 142])
def test_tunings_scale_with_the_sm_count(sms, n):
    sms(n)
    assert device.num_sms() == n
    for dtype in ("bfloat16", "float8_e4m3fn"):
        t = pallas_decode.default_tuning(_cfg(dtype))
        assert t.target_programs == 4 * n
        assert t.unsplit_programs == (3 * n // 2, 3 * n)
    assert mosaic_mla.MosaicMLATuning().target_programs == round(128 * n / 132)
    # an explicit setting is kept
    assert pallas_decode.DecodeTuning(target_programs=7).target_programs == 7


def test_a_device_without_the_attribute(sms, monkeypatch):
    device.num_sms.cache_clear()
    monkeypatch.setattr(device.jax, "devices",
                        lambda kind=None: [types.SimpleNamespace(platform="gpu")])
    assert device.num_sms() == 132


@pytest.mark.gpu
def test_reads_the_real_card():
    d = jax.devices("gpu")[0]
    device.num_sms.cache_clear()
    assert device.num_sms() == d.core_count > 0
