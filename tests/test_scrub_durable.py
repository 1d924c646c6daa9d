"""A scrub asked for is remembered at once: `bulwark scrub` returns only once
the request is durable, so a crash (kill -9) right after it still finds the
scrub on restart, which resumes it (before, a crash in its first seconds
forgot it: 'none requested'). Pause and cancel are durable the same way."""

from conftest import qemu_io_ok
from healing import scrub_status


def test_a_scrub_killed_at_once_resumes(make_pool):
    p = make_pool(layout="mirror:2", devices=2, device_size="256M",
                  serve_args=["--scrub-rate", "1M"])
    p.create().start()
    p.create_volume("v", size="32M", encryption=False, compression="off")
    qemu_io_ok(p.uri("v"), "write -P 9 0 16M", "flush")
    p.cli("scrub")
    p.kill()
    p.start()
    s = scrub_status(p)
    assert s["kind"] == "scrub" and s["state"] in ("scanning", "finished"), s
    assert "resuming the scrub" in p.log_path.read_text(), p.log_tail()

    p.cli("scrub", "cancel")
    p.kill()
    p.start()
    s = scrub_status(p)
    assert s["state"] == "canceled", s
