"""bench.common.override_decode_tuning (bench.decode_floor --decode-variant, bench.decode_floor
and bench.offline --decode-one-wave off): the engine's decode tuning (it asks
pallas_decode.default_tuning when it traces) takes the given variant for fp8 pages only, and
the one-wave rule can be turned off for an A/B; override_split_loop sets the split loop."""

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


def test_split_loop_override_sets_both_kernels_and_none_keeps_the_defaults(monkeypatch):
    """bench.offline / bench.decode_floor --split-loop on|off: Variant.split_loop in the decode
    and prefill defaults (the defaults: fp8 prefill only); no flag leaves them alone."""
    from bench.common import override_split_loop
    from jfp8kv.kernels import pallas_prefill

    for mod in (pallas_decode, pallas_prefill):
        monkeypatch.setattr(mod, "default_tuning", mod.default_tuning)
    fp8, bf16 = _cfgs()
    assert pallas_prefill.default_tuning(fp8).variant.split_loop
    assert not pallas_prefill.default_tuning(bf16).variant.split_loop
    assert not pallas_decode.default_tuning(fp8).variant.split_loop
    override_split_loop(None)
    assert pallas_prefill.default_tuning(fp8).variant.split_loop
    override_split_loop(False)
    assert not any(mod.default_tuning(c).variant.split_loop
                   for mod in (pallas_decode, pallas_prefill) for c in (fp8, bf16))
    override_split_loop(True)
    assert all(mod.default_tuning(c).variant.split_loop
               for mod in (pallas_decode, pallas_prefill) for c in (fp8, bf16))
    assert pallas_decode.default_tuning(fp8).variant.asm  # the rest of the variant is kept
