"""The K/V pool's static values, resolved at build: static fp8 scales (``tensor`` and
``channel`` modes: a float for every layer, a scales JSON, the checkpoint's ``k_scale`` /
``v_scale``, or calibration on the built-in text) and the K shift of a smoothing
``kv_rotation`` (a scales JSON or calibration). ``static_pool_args`` hands them to
``Cache.init`` as the pool's arguments."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from jfp8kv.config import CacheConfig
from jfp8kv.kvcache import calibrate, fp8, k_transform, scale_modes
from jfp8kv.kvcache.layout import CacheLayout

log = logging.getLogger(__name__)


def static_pool_args(loaded, layout: CacheLayout, page_size: int, kv_scales, tp=None):
    """(pool_args, source): the K/V pool's static scales and K shift when its scale mode or
    K transform needs them (``resolve_static_scales``), as ``Cache.init``'s pool arguments."""
    pool = layout.pool("kv")
    if pool is None:
        if kv_scales is not None and fp8.is_fp8(layout.storage_dtype):
            log.warning("kv_scales is ignored: %s's fp8 scales are computed at store time",
                        layout.family)
        return {}, None
    ccfg = dataclasses.replace(pool.config, page_size=page_size)
    k, v, shift, source = resolve_static_scales(loaded, ccfg, kv_scales, tp)
    if tp is not None:
        k, v = (None if x is None else tp.expand_kv_heads(x) for x in (k, v))
    args = dict(k_scale=k, v_scale=v, k_shift=shift)
    return {"kv": {n: x for n, x in args.items() if x is not None}}, source


def resolve_static_scales(loaded, ccfg: CacheConfig, kv_scales, tp=None):
    """(k_scale, v_scale, k_shift, source): static scales for static scale modes and the K
    shift of a smoothing ``ccfg.kv_rotation``, None where not needed. ``kv_scales``: a float
    for every layer, a scales JSON path, or None (the checkpoint's k_scale/v_scale, else
    calibration on the built-in text, run on ``tp``'s mesh). Scales and shift are [layers,
    model KV heads, head_dim]; ``ccfg``'s own head count is not read. Checkpoint scales
    describe unrotated K: with a K transform they are not used (calibration instead)."""
    static = scale_modes.of(ccfg).is_static
    smooth = k_transform.smooths(ccfg.kv_rotation)
    if not static and not smooth:
        if kv_scales is not None and ccfg.is_fp8:
            log.warning("kv_scales is ignored: kv_scale_mode=%s computes scales at store "
                        "time", ccfg.scale_mode)
        return None, None, None, None
    shape = (ccfg.num_layers, loaded.config.num_kv_heads, ccfg.head_dim)
    if not static and isinstance(kv_scales, (int, float)):
        log.warning("kv_scales=%s is ignored: kv_scale_mode=%s computes scales at store time",
                    kv_scales, ccfg.scale_mode)
        kv_scales = None
    if isinstance(kv_scales, (int, float)):
        if kv_scales == 1.0:
            fp8.warn_unit_scale()
        s = np.full(shape, kv_scales, np.float32)
        shift = _measured_shift(loaded, ccfg, None, tp) if smooth else None
        return s, s, shift, f"constant {kv_scales}"
    if not static:  # a dynamic mode that smooths: the K mean is all it needs
        return None, None, _measured_shift(loaded, ccfg, kv_scales, tp), None
    if kv_scales is None and ccfg.kv_rotation == "none" and (
            loaded.kv_scales is not None):
        k, v = (np.broadcast_to(np.asarray(loaded.kv_scales[n], np.float32)[:, None, None],
                                shape) for n in ("k", "v"))
        log.info("fp8 KV: using the checkpoint's k_scale/v_scale tensors")
        return k, v, None, "checkpoint k_scale/v_scale"
    amax = _measured(loaded, ccfg, kv_scales, tp)
    k, v = amax.scales(ccfg.storage_dtype, ccfg.scale_mode)
    return k, v, amax.k_mean if smooth else None, amax.source


def _measured(loaded, ccfg: CacheConfig, path: str | None, tp) -> calibrate.KVAmax:
    """The K/V amax (and K mean) in ``ccfg.kv_rotation``'s basis: from a scales JSON, else
    calibration on the built-in text."""
    rot = ccfg.kv_rotation
    if path is not None:
        amax = calibrate.KVAmax.from_json(path, calibrate.fingerprint(loaded.config))
        if amax.kv_rotation != rot:
            raise ValueError(
                f"{path} was measured with kv_rotation={amax.kv_rotation!r}, this cache "
                f"stores K with kv_rotation={rot!r}; run `python -m jfp8kv.calibrate --model "
                f"<this model> --kv-rotation {rot} --out scales.json`")
        return amax
    from jfp8kv.engine.calibrate import calibrate_on_text

    _warn_builtin_calibration(rot)
    return calibrate_on_text(loaded, [calibrate.BUILTIN_TEXT], page_size=ccfg.page_size,
                             tp=tp, kv_rotation=rot)


def _measured_shift(loaded, ccfg: CacheConfig, path: str | None, tp) -> np.ndarray:
    """A smoothing ``ccfg.kv_rotation``'s K mean: from a scales JSON, else one calibration
    pass over the built-in text (no amax pass: nothing static is scaled by it)."""
    if path is not None:
        return _measured(loaded, ccfg, path, tp).k_mean
    from jfp8kv.engine.calibrate import measure_k_mean

    _warn_builtin_calibration(ccfg.kv_rotation)
    return measure_k_mean(loaded.config, loaded.params,
                          [loaded.tokenizer.encode(calibrate.BUILTIN_TEXT)],
                          page_size=ccfg.page_size, tp=tp)


def _warn_builtin_calibration(rot: str) -> None:
    why = ("K transform kv_rotation=%s (checkpoint k_scale/v_scale describe unrotated K)"
           % rot if rot != "none" else "static scales")
    log.warning("fp8 KV with %s and no kv_scales file: calibrating at start-up on the "
                "built-in text (pass a scales JSON from `python -m jfp8kv.calibrate` for "
                "numbers measured on your own data)", why)
