"""bench.common.override_decode_tuning (bench.decode_floor --decode-variant, bench.decode_floor
and bench.offline --decode-one-wave off): the engine's decode tuning (it asks
pallas_decode.default_tuning when it traces) takes the given variant for fp8 pages only, and
the one-wave rule can be turned off for an A/B."""

from bench.common import override_decode_tuning
from jfp8kv.kernels import pallas_decode
from tests.kernels.cases import make_cfg


def _cfgs():
    fp8 = make_cfg("float8_e4m3fn", "token", heads_kv=2, head_dim=128, page_size=16,
                   num_pages=8)
    bf16 = make_cfg("bfloat16", None, heads_kv=2, head_dim=128, page_size=16, num_pages=8)
    return fp8, bf16


def test_decode_variant_applies_to_fp8_pages_only(monkeypatch):
    monkeypatch.setattr(pallas_decode, "default_tuning", pallas_decode.default_tuning)
    fp8, bf16 = _cfgs()
    before = pallas_decode.default_tuning(fp8), pallas_decode.default_tuning(bf16)
    override_decode_tuning("pagepf+asm+vmask")
    after = pallas_decode.default_tuning(fp8)
    assert str(after.variant) == "pagepf+asm+vmask"
    assert after.block_k == before[0].block_k and after.num_stages == before[0].num_stages
    assert pallas_decode.default_tuning(bf16) == before[1]


def test_one_wave_rule_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(pallas_decode, "default_tuning", pallas_decode.default_tuning)
    fp8, bf16 = _cfgs()
    assert pallas_decode.choose_splits(32, 8, 4096, pallas_decode.default_tuning(fp8)) == 1
    override_decode_tuning(one_wave=False)
    for cfg in (fp8, bf16):
        t = pallas_decode.default_tuning(cfg)
        assert t.unsplit_programs == (0, 0)
        assert pallas_decode.choose_splits(32, 8, 4096, t) > 1
