"""Damaged metadata on one device: the pool imports and serves every byte.

1. A superblock slot at the front and one at the back of one device are
   overwritten, and one byte is flipped in every non-zero 64 KiB of the same
   device's data area, which hits map nodes and volume-table copies as well
   as data. The pool imports ONLINE, every read is exact, a scrub repairs the
   device, a second finds nothing, and the pool survives two more restarts
   (each commit rewrites the superblock slots in turn).
2. Every label (all four superblock slots) of one device is overwritten: the
   device is no longer recognised, the pool imports DEGRADED without it and
   serves every byte.
3. The first MiB of every device is zeroed (both front label slots: the
   accident of a `dd` to the wrong disk): the back copies, whose place the
   front slots used to tell, are found from the device's size, and the pool
   imports ONLINE, serves every byte and writes its front slots again.
"""

import os
import random

import pytest

from conftest import KiB, LONG_TEST_TIMEOUT_S, MiB, require_tools, run
from healing import (BLOCK, LAYOUTS, assert_clean_scrub, assert_export_equals, heal_pool,
                     new_token, pattern_image, scatter_damage, scrub_wait, write_file)

pytestmark = pytest.mark.timeout(LONG_TEST_TIMEOUT_S)  # waits of up to 300 s each

SLOT = 4 * KiB
SLOT_OFFSETS = (0, 256 * KiB)


def label_slots(path):
    """Offsets of the four superblock slots (docs/format.md: front MiB and back MiB)."""
    back = os.path.getsize(path) - 1 * MiB
    return [o for o in SLOT_OFFSETS] + [back + o for o in SLOT_OFFSETS]


def overwrite(path, offsets, rng):
    with open(path, "r+b") as f:
        for off in offsets:
            f.seek(off)
            f.write(rng.randbytes(SLOT))
        f.flush()
        os.fsync(f.fileno())


def setup(make_pool, tmp_path, rng, layout, faults=False):
    require_tools("nbdcopy")
    pool = heal_pool(make_pool, layout, faults=faults)
    key = pool.create_volume("enc", size="16M")
    pool.create_volume("plain", size="4M", encryption=False, compression="off")
    enc = write_file(tmp_path / "enc.img", rng.randbytes(16 * MiB))
    plain = write_file(tmp_path / "plain.img", pattern_image(new_token(rng), 4 * MiB // BLOCK))
    run(["nbdcopy", "--flush", enc, pool.uri("enc")])
    run(["nbdcopy", "--flush", plain, pool.uri("plain")])
    return pool, key, enc, plain


def check(pool, key, enc, plain, what):
    pool.load_key("enc", key)
    assert_export_equals(pool, "enc", enc, what)
    assert_export_equals(pool, "plain", plain, what, chunk=BLOCK)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_superblock_slots_and_map_damaged(make_pool, tmp_path, seed, layout):
    rng = random.Random(seed)
    pool, key, enc, plain = setup(make_pool, tmp_path, rng, layout)
    devices = pool.device_paths()
    pool.stop()

    victim = rng.choice(devices)
    slots = label_slots(victim)
    overwrite(victim, [slots[0], slots[3]], rng)
    flips = scatter_damage(victim, rng)
    print(f"{victim}: superblock slots at {slots[0]} and {slots[3]} overwritten, {len(flips)} bytes flipped")

    pool.start()
    # Every device is in use; the damaged one may show DEGRADED (errors counted) until a restart.
    st = pool.status()
    states = {d["path"]: d["state"] for d in st["devices"]}
    assert all(s in ("ONLINE", "DEGRADED") for s in states.values()), states
    check(pool, key, enc, plain, "after metadata damage")
    r, s = scrub_wait(pool)
    assert s["unrecoverable"] == 0 and s["repaired"] > 0, f"{s}\n{r.stdout}"
    assert_clean_scrub(pool, "second scrub")
    for n in range(2):
        pool.restart()
        st = pool.status()
        assert st["state"] == "ONLINE", st["devices"]
        check(pool, key, enc, plain, f"after restart {n + 1}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_labels_of_a_device_damaged(make_pool, tmp_path, seed, layout):
    rng = random.Random(seed)
    pool, key, enc, plain = setup(make_pool, tmp_path, rng, layout)
    devices = pool.device_paths()
    pool.stop()

    victim = rng.choice(devices)
    overwrite(victim, label_slots(victim), rng)

    pool.start()
    st = pool.status()
    assert st["state"] == "DEGRADED", st["state"]
    states = {d["path"]: d["state"] for d in st["devices"]}
    assert states.get(victim) == "UNAVAIL", states
    assert all(s == "ONLINE" for d, s in states.items() if d != victim), states
    check(pool, key, enc, plain, "with one device's labels destroyed")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_front_labels_of_every_device_zeroed(make_pool, tmp_path, seed, layout):
    rng = random.Random(seed)
    pool, key, enc, plain = setup(make_pool, tmp_path, rng, layout)
    devices = pool.device_paths()
    pool.stop()

    for d in devices:
        with open(d, "r+b") as f:
            f.write(bytes(1 * MiB))
            os.fsync(f.fileno())

    pool.start()
    st = pool.status()
    assert st["state"] == "ONLINE", st["devices"]
    assert "read from the back copies" in pool.log_path.read_text(), pool.log_tail()
    check(pool, key, enc, plain, "with the front MiB of every device zeroed")
    # Two commits write both front slots again: after them, the back copies are not needed.
    for n in range(2):
        pool.restart()
        assert pool.status()["state"] == "ONLINE"
        check(pool, key, enc, plain, f"after restart {n + 1}")
    pool.stop()
    for d in devices:
        with open(d, "rb") as f:
            for off in SLOT_OFFSETS:
                f.seek(off)
                assert any(f.read(SLOT)), f"{d}: front label slot at {off} still zero"


def test_every_label_slot_wiped_is_said_so(make_pool):
    """With all four label slots of a pool's only device zeroed, `serve` says every slot
    is damaged or wiped (it counted "0 slots altered or damaged", which reads as no
    damage at all)."""
    pool = make_pool(layout="single", devices=1, device_size="64M").create().start()
    (victim,) = pool.device_paths()
    pool.stop()
    with open(victim, "r+b") as f:
        for off in label_slots(victim):
            f.seek(off)
            f.write(bytes(SLOT))
    r = pool.bulwark("serve", pool.dir, check=False, timeout=60)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "every label slot (two at each device's start, two at its end) is damaged or wiped" \
        in r.stderr, r.stderr
    assert "panicked" not in r.stderr, r.stderr


def test_a_device_copied_over_another_is_named(make_pool):
    """mirror:2 with dev1 overwritten by a copy of dev0 (both carry member 0's label): the
    pool runs DEGRADED on one, and the log says why member 1 is missing (it said only
    that it was missing, naming a file that is there)."""
    import shutil
    pool = make_pool(layout="mirror:2", devices=2, device_size="64M").create().start()
    d0, d1 = pool.device_paths()
    pool.stop()
    shutil.copyfile(d0, d1)
    pool.start()
    assert pool.status()["state"] == "DEGRADED"
    log = pool.log_path.read_text()
    assert "carry the same member's label (one is a copy of the other)" in log, pool.log_tail()


def test_front_labels_zeroed_on_a_single_device_pool(make_pool):
    """The tester's case: a `single` pool (one device, no other copy anywhere) whose
    device's first MiB was zeroed imports from the back copies and serves its data."""
    from conftest import qemu_io_ok
    pool = make_pool(layout="single", devices=1, device_size="64M").create().start()
    pool.create_volume("p", size="16M", encryption=False)
    qemu_io_ok(pool.uri("p"), "write -P 0x5a 0 4M", "flush")
    (dev,) = pool.device_paths()
    pool.stop()
    with open(dev, "r+b") as f:
        f.write(bytes(1 * MiB))
        os.fsync(f.fileno())
    pool.start()
    assert pool.status()["state"] == "ONLINE"
    qemu_io_ok(pool.uri("p"), "read -P 0x5a 0 4M", "read -P 0 4M 12M")
