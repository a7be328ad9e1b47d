#!/usr/bin/env python3
"""Prepare memtrain's real datasets from Debian packages into a cache folder.

  text/austen.txt       Jane Austen's six novels (public domain), from r-cran-janeaustenr's
                        R data file: each book is one zlib record (big-endian u32 raw length, then
                        the zlib stream) holding an R XDR-serialised character vector, one line each.
  fashion-mnist/*       the four IDX files, gunzipped, as torch::data::datasets::MNIST expects.

Writes each output to a temporary name and renames it, so an interrupted run leaves no half file.
"""
import argparse, gzip, hashlib, os, shutil, struct, subprocess, sys, tempfile, zlib

AUSTEN_RDB = "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
FASHION_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_FILES = {  # name -> uncompressed size (data.md, checked against the IDX headers)
    "train-images-idx3-ubyte": 47040016,
    "train-labels-idx1-ubyte": 60008,
    "t10k-images-idx3-ubyte": 7840016,
    "t10k-labels-idx1-ubyte": 10008,
}


def atomic_write(path, data: bytes):
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def parse_r_character_vector(raw: bytes):
    """R XDR serialisation (format 3) of a STRSXP: header, then n CHARSXPs."""
    if raw[:2] != b"X\n":
        raise ValueError("not an R XDR stream")
    pos = 2
    version, = struct.unpack_from(">i", raw, pos); pos += 12  # version, R version, min R version
    if version == 3:
        nelen, = struct.unpack_from(">i", raw, pos); pos += 4 + nelen  # native encoding name
    flags, n = struct.unpack_from(">ii", raw, pos); pos += 8
    if flags & 0xFF != 16:
        raise ValueError(f"expected a character vector (type 16), got type {flags & 0xFF}")
    lines = []
    for _ in range(n):
        _, length = struct.unpack_from(">ii", raw, pos); pos += 8
        if length < 0:
            lines.append("")
            continue
        lines.append(raw[pos:pos + length].decode("utf-8"))
        pos += length
    return lines


def prepare_austen(out_dir, work_dir):
    out = os.path.join(out_dir, "text", "austen.txt")
    if os.path.exists(out):
        return
    os.makedirs(os.path.dirname(out), exist_ok=True)
    subprocess.run(["apt-get", "download", "-q", "r-cran-janeaustenr"], cwd=work_dir, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deb = [f for f in os.listdir(work_dir) if f.startswith("r-cran-janeaustenr") and f.endswith(".deb")][0]
    subprocess.run(["dpkg-deb", "-x", deb, "x"], cwd=work_dir, check=True)
    data = open(os.path.join(work_dir, "x", AUSTEN_RDB), "rb").read()
    books, off = [], 0
    while off < len(data):
        size, = struct.unpack_from(">I", data, off)
        dec = zlib.decompressobj()
        raw = dec.decompress(data[off + 4:])
        if len(raw) != size:
            raise ValueError(f"record at {off}: expected {size} bytes, inflated {len(raw)}")
        off = len(data) - len(dec.unused_data)
        books.append("\n".join(parse_r_character_vector(raw)))
    if len(books) != 6:
        raise ValueError(f"expected 6 novels in {AUSTEN_RDB}, found {len(books)}")
    text = "\n\n".join(books).encode("utf-8")
    atomic_write(out, text)
    print(f"prepared {out}: {len(text)} bytes, sha256 {hashlib.sha256(text).hexdigest()[:16]}")


def prepare_fashion(out_dir):
    dst = os.path.join(out_dir, "fashion-mnist")
    os.makedirs(dst, exist_ok=True)
    for name, size in FASHION_FILES.items():
        out = os.path.join(dst, name)
        if os.path.exists(out) and os.path.getsize(out) == size:
            continue
        src = os.path.join(FASHION_DIR, name + ".gz")
        if not os.path.exists(src):
            raise FileNotFoundError(f"{src} missing: install the Debian package dataset-fashion-mnist")
        raw = gzip.open(src, "rb").read()
        if len(raw) != size:
            raise ValueError(f"{src}: expected {size} bytes unpacked, got {len(raw)}")
        atomic_write(out, raw)
    print(f"prepared {dst}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        prepare_austen(args.out_dir, work)
    prepare_fashion(args.out_dir)


if __name__ == "__main__":
    sys.exit(main())
