"""bench.decode_floor --decode-variant: the engine's fp8 decode kernel takes the given
variant (the engine asks pallas_decode.default_tuning when it traces), bf16 keeps its own."""

from bench import decode_floor
from jfp8kv.kernels import pallas_decode
from tests.kernels.cases import make_cfg


def test_decode_variant_applies_to_fp8_pages_only(monkeypatch):
    monkeypatch.setattr(pallas_decode, "default_tuning", pallas_decode.default_tuning)
    fp8 = make_cfg("float8_e4m3fn", "token", heads_kv=2, head_dim=128, page_size=16,
                   num_pages=8)
    bf16 = make_cfg("bfloat16", None, heads_kv=2, head_dim=128, page_size=16, num_pages=8)
    before = pallas_decode.default_tuning(fp8), pallas_decode.default_tuning(bf16)
    decode_floor.use_decode_variant("pagepf+asm+vt")
    after = pallas_decode.default_tuning(fp8)
    assert str(after.variant) == "pagepf+asm+vt"
    assert after.block_k == before[0].block_k and after.num_stages == before[0].num_stages
    assert pallas_decode.default_tuning(bf16) == before[1]
