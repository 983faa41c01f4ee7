"""Index files checked before they are served: the fast hash the writer records (gare_index.store.fast_hash) and the
check at open (``open_version(check=True)``, gare_index.store.file_check).

Every file of a version altered in place at the same size (one byte of its payload flipped, same inode) is refused
by a checked open, naming the file; an unchecked open still accepts the .npy payloads and ann.faiss (what the check
is for); versions written before fast hashes open and are checked with sha256."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import xxhash

from gare_index.store import (
    FAST_HASH_SCHEME,
    SEAL_FILE,
    BackgroundCheck,
    ExistingFile,
    IndexCheckError,
    IndexFormatError,
    check_files,
    open_index,
    open_version,
    read_manifest,
    seal_status,
    verify_index,
    write_version,
)
from gare_index.store.fast_hash import BLOCK_BYTES, FastHasher, fast_file_hash
from tests.indexer.support import reseal
from tests.indexer.test_index_store import SHA, extra, synth_arrays


def naive_fast_hash(data: bytes) -> str:
    """The scheme by its definition: XXH3-128 of the 64 MiB blocks' XXH3-128 digests, concatenated."""
    blocks = [xxhash.xxh3_128(data[o:o + BLOCK_BYTES]).digest() for o in range(0, len(data), BLOCK_BYTES)]
    return f"{FAST_HASH_SCHEME}:{xxhash.xxh3_128(b''.join(blocks)).hexdigest()}"


def flip_in_place(path: Path, at: int | None = None) -> int:
    """Flip one byte of `path` in place (same inode, same size): in the middle of the file, past any header."""
    size = path.stat().st_size
    at = size // 2 if at is None else at
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x5A]))
    return at


def version_files(vdir: Path) -> list[str]:
    """Every file of a version, as its manifest names them (relative paths: fields/*.npy too)."""
    return sorted(p.relative_to(vdir).as_posix() for p in vdir.rglob("*") if p.is_file())


@pytest.fixture
def index(tmp_path) -> Path:
    arrays, meta = synth_arrays(64)
    write_version(tmp_path / "idx", arrays, meta, extra("flat"))
    return tmp_path / "idx"


def test_fast_hash_definition_and_streaming():
    """The streaming hasher (writes of any size, across block boundaries) and the file hash equal the definition."""
    rng = np.random.default_rng(0)
    data = rng.bytes(BLOCK_BYTES * 2 + 12345)
    want = naive_fast_hash(data)
    h = FastHasher()
    pos = 0
    for step in (1, 7, BLOCK_BYTES - 8, 3 << 20, BLOCK_BYTES + 5, len(data)):
        h.update(data[pos:pos + step])
        pos = min(len(data), pos + step)
    assert pos == len(data) and h.hexdigest() == want
    assert FastHasher().hexdigest() == naive_fast_hash(b"")
    other = bytearray(data)
    other[BLOCK_BYTES + 3] ^= 1
    assert naive_fast_hash(bytes(other)) != want


def test_writer_records_both_hashes_of_every_file(index):
    vdir = index / "versions" / "v000001"
    m = read_manifest(vdir)
    assert sorted(m.files) == [f for f in version_files(vdir) if f not in ("manifest.json", SEAL_FILE)]
    assert (vdir / SEAL_FILE).read_text() == naive_fast_hash((vdir / "manifest.json").read_bytes()) + "\n"
    for fname, entry in m.files.items():
        data = (vdir / fname).read_bytes()
        assert entry.sha256 == hashlib.sha256(data).hexdigest(), fname
        assert entry.fast_hash == naive_fast_hash(data) == fast_file_hash(vdir / fname), fname


def test_linked_files_keep_their_fast_hash(index, monkeypatch):
    """A version that links its predecessor's files (ExistingFile with their sha256) records the same fast hashes,
    taken from the predecessor's manifest: the linked files (GBs of frames) are not read again."""
    import gare_index.store.writer as writer

    def no_reread(path):
        raise AssertionError(f"{path} re-read to hash it")

    monkeypatch.setattr(writer, "fast_file_hash", no_reread)
    v1 = open_index(index)
    files = v1.manifest.files
    linked = {k: ExistingFile(v1.path / f"{k}.npy", files[f"{k}.npy"].sha256)
              for k in ("ids", "norms", "units", "frames", "masks", "biases")}
    name = write_version(index, linked, ExistingFile(v1.path / "meta.sqlite", files["meta.sqlite"].sha256),
                         extra("flat") | {"ann_params": dict(v1.manifest.ann_params)},
                         ann=ExistingFile(v1.path / "ann.faiss", files["ann.faiss"].sha256))
    v1.close()
    m2 = read_manifest(index / "versions" / name)
    assert {k: e.fast_hash for k, e in m2.files.items()} == {k: e.fast_hash for k, e in files.items()}
    open_version(index, name, check=True).close()


@pytest.mark.parametrize("fname", ["ann.faiss", "ids.npy", "norms.npy", "units.npy", "frames.npy", "masks.npy",
                                   "biases.npy", "meta.sqlite", "manifest.json", SEAL_FILE])
def test_every_file_altered_in_place_is_refused_at_open(index, fname):
    vdir = index / "versions" / "v000001"
    assert fname in version_files(vdir)
    open_index(index, check=True).close()
    flip_in_place(vdir / fname)
    with pytest.raises(IndexFormatError) as e:
        open_index(index, check=True, expect_checkpoint_sha=SHA).close()
    # the manifest and its seal: caught by the seal check, which names the manifest
    assert f"{vdir / (fname if fname != SEAL_FILE else 'manifest.json')}:" in str(e.value)
    if fname in ("ann.faiss", "units.npy", "frames.npy"):  # the finding: accepted without the check
        assert isinstance(e.value, IndexCheckError)
        open_index(index, check=False).close()


def test_check_names_every_bad_file_and_counts_bytes(index):
    vdir = index / "versions" / "v000001"
    m = read_manifest(vdir)
    rep = check_files(vdir, m.files, threads=3)
    assert rep.ok and rep.files == len(m.files) and rep.bytes == sum(e.bytes for e in m.files.values())
    flip_in_place(vdir / "frames.npy")
    flip_in_place(vdir / "units.npy", at=(vdir / "units.npy").stat().st_size - 1)  # the last byte
    rep = check_files(vdir, m.files, threads=1)
    assert len(rep.problems) == 2 and "frames.npy: fast hash" in rep.problems[0] and "units.npy: fast hash" in rep.problems[1]


def test_off_really_skips(index, monkeypatch):
    """check=False opens without reading the files: a hasher that raises is never called."""
    import gare_index.store.file_check as fc

    def boom(*a, **k):
        raise AssertionError("hashed although the check is off")

    monkeypatch.setattr(fc, "hash_block", boom)
    flip_in_place(index / "versions" / "v000001" / "frames.npy")
    open_index(index, check=False).close()
    with pytest.raises(AssertionError, match="hashed although"):
        open_index(index, check=True).close()


def _strip_fast_hashes(vdir: Path) -> None:
    m = json.loads((vdir / "manifest.json").read_text())
    for e in m["files"].values():
        e.pop("fast_hash")
    (vdir / "manifest.json").write_text(json.dumps(m, indent=1, sort_keys=True))
    reseal(vdir)


def test_version_without_fast_hashes_opens_and_is_checked_with_sha256(index, caplog):
    """A version written before fast hashes (no fast_hash in its manifest): opens, checked with sha256 (one
    WARNING), and an altered file is still refused."""
    vdir = index / "versions" / "v000001"
    _strip_fast_hashes(vdir)
    assert read_manifest(vdir).files["frames.npy"].fast_hash is None
    with caplog.at_level("WARNING", logger="gare_index.store.file_check"):
        open_index(index, check=True).close()
    assert any("checked with sha256" in r.getMessage() for r in caplog.records)
    rep = check_files(vdir, read_manifest(vdir).files)
    assert rep.ok and rep.sha256_files == sorted(read_manifest(vdir).files)
    flip_in_place(vdir / "frames.npy")
    with pytest.raises(IndexCheckError, match="frames.npy: sha256 does not match"):
        open_index(index, check=True).close()


def test_index_written_by_earlier_code_opens_checked_with_sha256(tmp_path):
    """The index tests/indexer/data holds (written by main at 78f2e78, before fast hashes): a checked open passes
    with every file checked against its sha256, and refuses it once a byte of frames.npy is flipped in place."""
    old = Path(__file__).parent / "data" / "index-main-78f2e78"
    idx = tmp_path / "old"
    shutil.copytree(old, idx)
    vdir = idx / "versions" / "v000001"
    files = read_manifest(vdir).files
    assert all(e.fast_hash is None for e in files.values())
    open_index(idx, check=True).close()
    assert check_files(vdir, files).sha256_files == sorted(files)
    flip_in_place(vdir / "frames.npy")
    with pytest.raises(IndexCheckError, match="frames.npy: sha256 does not match"):
        open_index(idx, check=True)


def test_background_check_is_waited_for_and_cancelled(index):
    vdir = index / "versions" / "v000001"
    m = read_manifest(vdir)
    chk = BackgroundCheck(vdir, m.files)
    open_version(index, "v000001", check=chk).close()  # the started check is the one waited for
    assert chk.done() and chk.wait().ok
    flip_in_place(vdir / "masks.npy")
    chk = BackgroundCheck(vdir, m.files)
    with pytest.raises(IndexCheckError, match="masks.npy"):
        open_version(index, "v000001", check=chk)
    stop = threading.Event()
    stop.set()
    assert check_files(vdir, m.files, stop=stop).problems == [f"{vdir}: check cancelled"]


def test_check_reads_the_manifest_it_was_opened_with(index):
    """A file and its manifest entry both rewritten after the open: the check of the served copy still fails."""
    v = open_index(index)
    vdir = v.path
    flip_in_place(vdir / "units.npy")
    m = json.loads((vdir / "manifest.json").read_text())
    m["files"]["units.npy"]["fast_hash"] = fast_file_hash(vdir / "units.npy")
    (vdir / "manifest.json").write_text(json.dumps(m))
    reseal(vdir)  # the pair rewritten consistently: only the manifest in memory tells
    assert check_files(vdir, read_manifest(vdir).files).ok
    assert not check_files(vdir, v.manifest.files).ok
    v.close()


def test_file_shrunk_or_missing(index):
    vdir = index / "versions" / "v000001"
    m = read_manifest(vdir)
    os.truncate(vdir / "frames.npy", m.files["frames.npy"].bytes - 1)
    (vdir / "biases.npy").unlink()
    rep = check_files(vdir, m.files)
    assert sorted(p.split(":")[0] for p in rep.problems) == [str(vdir / "biases.npy"), str(vdir / "frames.npy")]


def test_verify_rehash_catches_an_altered_fast_hash_in_the_manifest(index):
    """`gare-index verify` (rehash) holds every file to both recorded hashes: a manifest whose fast hash was
    altered in place (its sha256 entries intact) is reported, naming the file."""
    vdir = index / "versions" / "v000001"
    assert verify_index(index) == []
    m = json.loads((vdir / "manifest.json").read_text())
    fast = m["files"]["units.npy"]["fast_hash"]
    flipped = fast[:-1] + ("0" if fast[-1] != "0" else "1")
    (vdir / "manifest.json").write_text((vdir / "manifest.json").read_text().replace(fast, flipped))
    reseal(vdir)  # the rehash of the files is what this test watches, not the seal
    problems = verify_index(index)
    assert any("units.npy" in p and "fast hash" in p for p in problems), problems


# ------------------------------------------------------------------------------------------ the manifest's seal
def flip_hex_digit(vdir: Path, fname: str, key: str = "sha256") -> int:
    """Change one hex digit of files[fname][key] inside manifest.json, in place (still valid JSON of the same size,
    a record the fast check at open does not read when key is sha256); returns its offset."""
    mpath = vdir / "manifest.json"
    data = mpath.read_bytes()
    at = data.index(f'"{key}": "'.encode(), data.index(f'"{fname}": {{'.encode())) + len(f'"{key}": "') + 5
    with open(mpath, "r+b") as fh:
        fh.seek(at)
        fh.write(b"0" if data[at:at + 1] != b"0" else b"1")
    return at


def test_a_changed_sha256_record_in_the_manifest_is_refused(index):
    """One hex digit of units.npy's sha256 record changed in manifest.json (every file still matches its fast
    hash): a checked open, a started background check and verify refuse the version naming manifest.json; an
    unchecked open (the check's off switch) does not read the seal."""
    vdir = index / "versions" / "v000001"
    mpath = vdir / "manifest.json"
    flip_hex_digit(vdir, "units.npy")
    want = f"{mpath}: does not match its seal {SEAL_FILE}"
    with pytest.raises(IndexCheckError) as e:
        open_index(index, check=True, expect_checkpoint_sha=SHA)
    assert e.value.report.problems == [f"{want} (manifest or seal altered or corrupted)"]
    chk = BackgroundCheck(vdir, read_manifest(vdir).files)
    with pytest.raises(IndexCheckError, match="manifest.json: does not match its seal"):
        open_version(index, "v000001", check=chk)
    assert not chk.wait().ok  # cancelled by the refusal (or done first, and failed)
    assert check_files(vdir, read_manifest(vdir).files).problems[0].startswith(want)  # the check on its own finds it
    with pytest.raises(IndexFormatError, match="manifest.json: does not match its seal"):
        open_index(index, verify=True)
    assert verify_index(index)[0].startswith(want)
    assert verify_index(index, rehash=False)[0].startswith(want)
    open_index(index, check=False).close()


def test_every_byte_of_the_seal_changed_is_refused(index):
    vdir = index / "versions" / "v000001"
    files = read_manifest(vdir).files
    good = (vdir / SEAL_FILE).read_bytes()
    assert check_files(vdir, files).ok and seal_status(vdir).state == "sealed"
    variants = [good[:at] + bytes([good[at] ^ mask]) + good[at + 1:] for at in range(len(good)) for mask in (1, 0x5A)]
    variants += [b"", good[:-1], good + b"\n", good.upper(), good.replace(FAST_HASH_SCHEME.encode(), b"xxh3-64")]
    for bad in variants:
        (vdir / SEAL_FILE).write_bytes(bad)
        rep = check_files(vdir, files)
        assert len(rep.problems) == 1 and rep.problems[0].startswith(f"{vdir / 'manifest.json'}: "), (bad, rep.problems)
    with pytest.raises(IndexCheckError, match="manifest.json: its seal manifest.json.xxh3 uses scheme 'xxh3-64'"):
        open_index(index, check=True)
    (vdir / SEAL_FILE).write_bytes(good)
    open_index(index, check=True).close()


def test_an_unsealed_version_is_served_with_a_warning_and_can_be_sealed(tmp_path, caplog, capsys):
    """A version written before seals (the index tests/indexer/data holds): served by a checked open with one
    WARNING naming it and the way to seal it; `verify` passes and says unsealed; `seal` refuses while a data file
    differs from the manifest, then seals; verify says sealed; the sealed manifest is then held to its seal."""
    from gare_build.cli import main

    idx = tmp_path / "old"
    shutil.copytree(Path(__file__).parent / "data" / "index-main-78f2e78", idx)
    vdir = idx / "versions" / "v000001"
    assert not (vdir / SEAL_FILE).exists()
    with caplog.at_level("WARNING"):
        v = open_index(idx, check=True)
    v.close()
    warned = [r.getMessage() for r in caplog.records if SEAL_FILE in r.getMessage()]
    assert len(warned) == 1 and "index version v000001" in warned[0], warned
    assert f"gare-index seal --index {idx} --version v000001" in warned[0]
    assert v.check_report.ok and not v.check_report.sealed
    assert verify_index(idx) == []
    capsys.readouterr()
    assert main(["verify", "--out", str(idx)]) == 0
    assert "OK (padded rows masked; unsealed: written before manifests were sealed" in capsys.readouterr().out
    assert main(["verify", "--out", str(idx), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sealed"] is False

    at = flip_in_place(vdir / "frames.npy")
    assert main(["seal", "--out", str(idx)]) == 1
    assert "frames.npy: sha256 does not match" in capsys.readouterr().err and not (vdir / SEAL_FILE).exists()
    flip_in_place(vdir / "frames.npy", at)
    assert main(["seal", "--out", str(idx)]) == 0
    assert capsys.readouterr().out.strip() == f"seal: {idx} v000001 sealed"
    assert (vdir / SEAL_FILE).read_bytes() == (naive_fast_hash((vdir / "manifest.json").read_bytes()) + "\n").encode()
    assert main(["verify", "--out", str(idx)]) == 0
    assert capsys.readouterr().out.endswith("OK (padded rows masked; sealed)\n")
    assert main(["seal", "--out", str(idx), "--version", "v000001"]) == 0
    assert capsys.readouterr().out.strip().endswith("v000001 already sealed")
    caplog.clear()
    with caplog.at_level("WARNING"):
        open_index(idx, check=True).close()
    assert not any(SEAL_FILE in r.getMessage() for r in caplog.records)

    flip_hex_digit(vdir, "units.npy")
    with pytest.raises(IndexCheckError, match="manifest.json: does not match its seal"):
        open_index(idx, check=True)
    assert main(["seal", "--out", str(idx)]) == 1  # a seal that does not match is not replaced
    assert "not sealing" in capsys.readouterr().err
