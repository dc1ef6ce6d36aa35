"""Mirrors (colibri/io/mirrors.py): expert reads striped over copies of the expert files on other
drives give the tokens the model's own files give; each expert is read whole from one drive,
the drives' shares following their weights; a mirror file that differs at start, or fails a
read later, is read from the primary with one warning; a missing mirror directory is a one-line
error; `colibri run --mirror` takes it; `colibri plan --drives` sums the drives' bandwidth."""
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from tools import gguf_synthetic, synthetic_moe

from colibri import ColibriError, Engine
from colibri.io.container import Container
from colibri.io.expert_reader import ExpertReader, aligned_buffer
from colibri.io.experts import ResidentExperts
from colibri.io.gguf_link import link_gguf
from colibri.io.mirrors import Drives, parse_mirror

GiB = 1 << 30
LAYER = "model.layers.1.mlp"
PROMPT = [100, 2000, 3000, 400, 5000, 60, 700]
OTHER = [900, 80, 7000, 600, 50]
ALMOST_NONE = 1e-9  # a primary weight that leaves (nearly) every expert to the mirror

pytestmark = pytest.mark.usefixtures("private_cache")  # tests/io/conftest.py


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random OLMoE-shaped container: 3 MoE layers of 8 experts, one expert file each."""
    return synthetic_moe.write_container(tmp_path_factory.mktemp("mirror") / "m", "tiny", progress=False)


@pytest.fixture(scope="module")
def linked(model, tmp_path_factory):
    """The same model as a GGUF read in place: three ranges per expert, in a file outside the
    model's directory."""
    d = tmp_path_factory.mktemp("gguf")
    return link_gguf(gguf_synthetic.write_gguf(d / "m.gguf", model), d / "linked", progress=False)


@pytest.fixture(scope="module")
def reference(model):
    """PROMPT's and OTHER's greedy tokens, every expert read from the model's own files."""
    e = streamed(model)
    return tokens(e, PROMPT), tokens(e, OTHER)


def expert_files(model: Path) -> list[Path]:
    c = Container(model)
    return sorted({p for prefix in c.expert_layouts for p in c.expert_paths(prefix)})


def mirror_of(model: Path, where: Path) -> Path:
    """A mirror as the docs make one: the expert files copied to another directory."""
    where.mkdir(parents=True)
    for path in expert_files(model):
        shutil.copy(path, where / path.name)
    return where


def streamed(model: Path, **options) -> Engine:
    """Every routed expert read from disk at each use: a budget of the dense weights and half an
    expert per layer leaves no RAM slot (staging buffers only)."""
    c = Container(model)
    per_layer = sum(l.blob_bytes for l in c.expert_layouts.values())
    return Engine.load(model, ram_gb=(c.dense_bytes + 0.5 * per_layer) / GiB, stream_experts=True, **options)


def tokens(engine: Engine, prompt: list[int]) -> list[int]:
    return engine.generate(prompt, max_tokens=8, stop_at_eos=False).token_ids


@pytest.fixture
def reads(monkeypatch):
    """Every os.preadv of this process from now on, as (the file read, offset)."""
    seen = []
    preadv = os.preadv

    def spy(fd, buffers, offset, *flags):
        got = preadv(fd, buffers, offset, *flags)
        seen.append((Path(os.readlink(f"/proc/self/fd/{fd}")), offset))
        return got

    monkeypatch.setattr(os, "preadv", spy)
    return seen


def files_read(reads) -> set[Path]:
    return {path for path, _ in reads}


def mirror_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "mirror file" in str(w.message)]


# ----------------------------------------------------------------------------- the same tokens

def test_a_mirror_gives_the_same_tokens_and_shares_the_reads(model, reference, tmp_path):
    mirror = mirror_of(model, tmp_path / "mirror")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        e = streamed(model, mirrors=[str(mirror)])
        assert (tokens(e, PROMPT), tokens(e, OTHER)) == reference
    assert mirror_warnings(caught) == []  # an intact mirror warns of nothing
    drives = e.experts.drive_stats()
    assert list(drives) == [str(model), str(mirror)]
    # Equal weights over the ~20 experts these prompts route to: both drives read (a drive
    # drawing none of them has odds of ~2^-20).
    assert all(d["reads"] > 0 and d["bytes_read"] > 0 and d["read_s"] > 0 and d["errors"] == 0
               for d in drives.values()), drives
    assert sum(d["bytes_read"] for d in drives.values()) == e.expert_stats["bytes_read"]
    assert [d["weight"] for d in drives.values()] == [1.0, 1.0]


def test_resident_experts_read_over_mirrors_hold_the_same_bytes(model, tmp_path):
    """Every expert read at start, striped: the same blobs as from the model's own files; the
    counters stay readable once the load has closed the files."""
    mirror = mirror_of(model, tmp_path / "mirror")
    c = Container(model)
    plain = ResidentExperts(c)
    striped = ResidentExperts(Container(model), mirrors=[(mirror, 2.0)])
    assert striped.complete
    for prefix, layout in c.expert_layouts.items():
        ids = list(range(layout.num_experts))
        want = {e: blob.copy() for e, blob in plain.iter_experts(prefix, ids, blobs=True)}
        for e, blob in striped.iter_experts(prefix, ids, blobs=True):
            assert np.array_equal(blob, want[e])
    drives = striped.drive_stats()
    assert sum(d["reads"] for d in drives.values()) == sum(l.num_experts for l in c.expert_layouts.values())
    assert sum(d["bytes_read"] for d in drives.values()) == c.expert_bytes


# ----------------------------------------------------------------------------- one drive per expert

@pytest.mark.parametrize("kind", ["container", "gguf"])
def test_each_expert_is_read_whole_from_the_drive_it_is_striped_to(model, linked, tmp_path, reads, kind):
    """Every expert of the model read once through one reader over the primary and a mirror of
    weight 3: all of an expert's ranges (three in the GGUF) come from the drive `choose` names,
    and each drive's counters add up to its experts' bytes."""
    source = model if kind == "container" else linked
    c = Container(source)
    mirror = mirror_of(source, tmp_path / "mirror")
    reader = ExpertReader(c, "off", mirrors=[(mirror, 3.0)])
    roots = [c.dir if kind == "container" else expert_files(source)[0].parent, mirror]
    want = {0: [0, 0], 1: [0, 0]}  # drive -> [bytes, reads]
    for prefix, layout in c.expert_layouts.items():
        buf = aligned_buffer(layout.blob_bytes)
        for e in range(layout.num_experts):
            reads.clear()
            nbytes = reader.read(prefix, e, buf, verify=True)
            drive = reader.drives.choose(prefix, e)
            assert len(reads) == len(c.expert_ranges(prefix, e))
            assert {path.parent for path, _ in reads} == {roots[drive].resolve()}, (prefix, e)
            want[drive][0] += nbytes
            want[drive][1] += 1
    stats = reader.drive_stats()
    assert [[s["bytes_read"], s["reads"]] for s in stats.values()] == [want[0], want[1]]
    assert [s["weight"] for s in stats.values()] == [1.0, 3.0]
    reader.close()


def test_drive_shares_follow_the_weights_and_a_drive_leaving_moves_only_its_experts(model, tmp_path):
    """Over 20000 (layer, expert) keys, a drive's share of the experts is its share of the
    weights. The tolerance, 0.02, is over 6 standard deviations of a share drawn at random
    (sqrt(p (1 - p) / n) <= 0.0035 at n = 20000), far below the 0.25 that telling 1:3 from 1:1
    needs."""
    a, b = mirror_of(model, tmp_path / "a"), mirror_of(model, tmp_path / "b")
    keys = [(f"model.layers.{i // 256}.mlp", i % 256) for i in range(20000)]
    c = Container(model)
    for weights in ([1.0, 3.0], [1.0, 1.0, 2.0]):
        drives = Drives(c, [(d, w) for d, w in zip((a, b), weights[1:])], primary_weight=weights[0])
        counts = np.bincount([drives.choose(p, e) for p, e in keys], minlength=len(weights))
        shares = counts / len(keys)
        assert np.abs(shares - np.array(weights) / sum(weights)).max() < 0.02, shares
    three = Drives(c, [(a, 1.0), (b, 1.0)])
    two = Drives(c, [(a, 1.0)])  # b leaves
    before = [three.choose(p, e) for p, e in keys]
    after = [two.choose(p, e) for p, e in keys]
    assert all(x == y for x, y in zip(before, after) if x != 2)  # only b's experts move
    assert {y for x, y in zip(before, after) if x == 2} == {0, 1}  # and they spread over the rest


# ----------------------------------------------------------------------------- a bad mirror at start

def _damage_header(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)


def _grow(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)


@pytest.mark.parametrize("damage,what", [(Path.unlink, "is missing"),
                                         (_damage_header, "differs in its first 4096 bytes"),
                                         (_grow, "bytes, the primary")])
def test_a_mirror_file_that_differs_at_start_is_read_from_the_primary(model, reference, tmp_path, reads,
                                                                      damage, what):
    mirror = mirror_of(model, tmp_path / "mirror")
    primary_file, = Container(model).expert_paths(LAYER)
    bad = mirror / primary_file.name
    damage(bad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        e = streamed(model, mirrors=[str(mirror)], primary_weight=ALMOST_NONE)
        assert tokens(e, PROMPT) == reference[0]
    said = mirror_warnings(caught)
    assert len(said) == 1 and str(bad) in said[0] and what in said[0], said
    read = files_read(reads)
    assert bad.resolve() not in read and primary_file.resolve() in read  # that file: all from the primary
    others = {mirror.resolve() / p.name for p in expert_files(model) if p != primary_file}
    assert others <= read  # the other files: from the mirror
    assert e.experts.drive_stats()[str(mirror)]["errors"] == 0


# ----------------------------------------------------------------------------- a mirror damaged later

def _flip_every_expert(model: Path, copy: Path) -> None:
    """Invert 8 bytes in the middle of each expert's range of LAYER in the mirror's copy."""
    c = Container(model)
    with open(copy, "r+b") as f:
        for e in range(c.expert_layouts[LAYER].num_experts):
            _, offset, nbytes = c.expert_range(LAYER, e)
            f.seek(offset + nbytes // 2)
            raw = f.read(8)
            f.seek(offset + nbytes // 2)
            f.write(bytes(b ^ 0xFF for b in raw))


def _truncate(model: Path, copy: Path) -> None:
    """Cut the mirror's copy inside its first expert of LAYER: every read of the layer is short."""
    _, offset, _ = Container(model).expert_range(LAYER, 0)
    os.truncate(copy, offset + 4096)


@pytest.mark.parametrize("damage", [_flip_every_expert, _truncate])
def test_a_mirror_damaged_while_serving_is_left_for_the_primary(model, reference, tmp_path, reads, damage):
    """A mirror file damaged after the start check (the checksum catches flipped bytes, the
    reader a short read): the read is done again from the primary, the tokens do not change,
    one warning names the file, and its later reads go to the primary."""
    mirror = mirror_of(model, tmp_path / "mirror")
    primary_file, = Container(model).expert_paths(LAYER)
    bad = mirror / primary_file.name
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        e = streamed(model, mirrors=[str(mirror)], primary_weight=ALMOST_NONE)
        damage(model, bad)
        assert tokens(e, PROMPT) == reference[0]
        said = mirror_warnings(caught)
        assert len(said) == 1 and str(bad) in said[0] and "failed a read" in said[0], said
        assert ("checksum" if damage is _flip_every_expert else "truncated") in said[0]
        assert e.experts.drive_stats()[str(mirror)]["errors"] >= 1  # (two readers may both have met it)
        reads.clear()
        assert tokens(e, OTHER) == reference[1]
        assert len(mirror_warnings(caught)) == 1
    read = files_read(reads)
    assert bad.resolve() not in read and primary_file.resolve() in read
    assert mirror.resolve() / expert_files(model)[0].name in read  # the mirror's other files still serve


# ----------------------------------------------------------------------------- mistakes

def test_mirror_mistakes_are_one_line_errors(model, tmp_path):
    (tmp_path / "file").write_text("")
    cases = [
        ({"mirrors": [str(tmp_path / "nowhere")]}, "no such directory"),
        ({"mirrors": [str(tmp_path / "file")]}, "is not a directory"),
        ({"mirrors": [f"{tmp_path}:0"]}, "weight must be a number > 0"),
        ({"mirrors": [f"{tmp_path}:-2"]}, "weight must be a number > 0"),
        ({"mirrors": [str(tmp_path)], "primary_weight": 0.0}, "--primary-weight"),
        ({"mirrors": [str(tmp_path)], "expert_io": "mmap"}, "--expert-io mmap"),
        ({"mirrors": [str(tmp_path), str(tmp_path)]}, "given twice"),
    ]
    for options, message in cases:
        with pytest.raises(ColibriError, match=message) as err:
            streamed(model, **options)
        assert "\n" not in str(err.value)
    with pytest.raises(ColibriError, match="no such directory"):
        ExpertReader(Container(model), "off", mirrors=[(tmp_path / "nowhere", None)])


def test_a_weight_follows_the_last_colon_of_a_number():
    assert parse_mirror("/mnt/a") == (Path("/mnt/a"), None)
    assert parse_mirror("/mnt/a:2.5") == (Path("/mnt/a"), 2.5)
    assert parse_mirror("/mnt/a:b") == (Path("/mnt/a:b"), None)  # a colon in the name


# ----------------------------------------------------------------------------- the command line

def colibri(*args):
    return subprocess.run([sys.executable, "-m", "colibri.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONWARNINGS": "always"})


def test_colibri_run_takes_mirrors(model, tmp_path):
    c = Container(model)
    ram_gb = (c.dense_bytes + 0.5 * sum(l.blob_bytes for l in c.expert_layouts.values())) / GiB  # streamed
    args = ("run", "--model", model, "--raw", "--max-tokens", "6", "--ram-gb", f"{ram_gb:.6f}", "once upon a time")
    mirror, empty = mirror_of(model, tmp_path / "mirror"), tmp_path / "empty"
    empty.mkdir()
    plain = "".join(ev.text for ev in streamed(model).stream("once upon a time", max_tokens=6, raw=True))
    striped = colibri(*args, "--mirror", f"{mirror}:2", "--mirror", empty, "--primary-weight", "0.5")
    assert striped.returncode == 0, striped.stderr
    assert striped.stdout == plain + "\n" and plain.strip()
    # The flags reached the reader: the empty mirror has none of the files, one warning each.
    assert striped.stderr.count(f"mirror file {empty}") == len(expert_files(model)), striped.stderr
    bad = colibri(*args, "--mirror", tmp_path / "nowhere")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert " ".join(bad.stderr.split()).startswith(f"error: --mirror {tmp_path / 'nowhere'}: no such directory")


def test_plan_sums_the_drives_bandwidth(model, tmp_path):
    from colibri.plan import Machine, analyze_model, build_plan, parse_machine_spec

    facts = analyze_model(model)
    c = Container(model)
    ram_gb = (c.dense_bytes + 0.5 * sum(l.blob_bytes for l in c.expert_layouts.values())) / GiB  # experts miss
    one = build_plan(facts, parse_machine_spec("box:ram_gb=8,disk_gbs=0.5,cores=2"), ram_gb=ram_gb)
    two = build_plan(facts, parse_machine_spec("box:ram_gb=8,disk_gbs=0.5,cores=2,drives=2"), ram_gb=ram_gb)
    assert (one["projection"]["disk_gbs"], two["projection"]["disk_gbs"]) == (0.5, 1.0)
    assert two["projection"]["drives"] == 2
    lo1, hi1 = one["projection"]["seconds_per_token"]["disk"]
    lo2, hi2 = two["projection"]["seconds_per_token"]["disk"]
    assert hi1 > 0 and (lo2, hi2) == pytest.approx((lo1 / 2, hi1 / 2))
    here = tmp_path / "here.json"
    machine = Machine(cores=2, ram_total_bytes=GiB, ram_available_bytes=GiB, disk_read_gbs=0.5, disk_probe="test")
    here.write_text(json.dumps(machine.to_dict()))
    shown = colibri("plan", "-m", model, "--machine", here, "--drives", "2")
    assert shown.returncode == 0, shown.stderr
    assert "striped over 2 drives: 1.00 GB/s" in " ".join(shown.stdout.split())
