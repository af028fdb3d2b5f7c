"""Writes seed corpora for the fuzz targets from real torch.save output.

    python tests/fuzz/make_seeds.py OUT_DIR
creates OUT_DIR/zip (whole archives) and OUT_DIR/pickle (their data.pkl records): state
dicts of every dtype, tied storages, views, Parameters, fp8 (_rebuild_tensor_v3), pickle
protocols 2-5, an OrderedDict with _metadata, a plain dict, and a Python-zipfile archive
without 64-byte alignment.
"""

import collections
import io
import os
import sys
import zipfile

import torch


def states():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(64, generator=gen)
    emb = torch.randn(5, 3, generator=gen).to(torch.bfloat16)
    sd = collections.OrderedDict()
    sd["view"] = base[8:32].view(4, 6)
    sd["rest"] = base[32:]
    sd["emb"] = emb
    sd["head"] = emb.view(5, 3)
    sd["p"] = torch.nn.Parameter(torch.ones(2, 2))
    sd["i64"] = torch.tensor(2**40)
    sd["half"] = torch.randn(3, generator=gen).half()
    sd["f64"] = torch.randn(2, generator=gen).double()
    sd["b"] = torch.tensor([True, False])
    sd["u8"] = torch.arange(4, dtype=torch.uint8)
    sd["fp8"] = torch.zeros(4, dtype=torch.float8_e4m3fn)
    sd["u16"] = torch.zeros(3, dtype=torch.uint16)
    sd["empty"] = torch.empty(0, 3)
    sd._metadata = collections.OrderedDict({"": {"version": 1}, "x": {"version": 2}})
    yield "ordered", sd
    yield "plain", {"a": torch.randn(3, 2, generator=gen), "b": torch.arange(5)}
    yield "empty", {}


def main(out):
    os.makedirs(os.path.join(out, "zip"), exist_ok=True)
    os.makedirs(os.path.join(out, "pickle"), exist_ok=True)
    for name, sd in states():
        for proto in (2, 3, 4, 5):
            buf = io.BytesIO()
            torch.save(sd, buf, pickle_protocol=proto)
            raw = buf.getvalue()
            with open(os.path.join(out, "zip", f"{name}-p{proto}.bin"), "wb") as f:
                f.write(raw)
            with zipfile.ZipFile(io.BytesIO(raw)) as z:
                pkl = [n for n in z.namelist() if n.endswith("/data.pkl")][0]
                with open(os.path.join(out, "pickle", f"{name}-p{proto}.pkl"), "wb") as f:
                    f.write(z.read(pkl))
                # The same records rewritten by Python's zipfile (other layout, no ZIP64).
                again = io.BytesIO()
                with zipfile.ZipFile(again, "w") as w:
                    for info in z.infolist():
                        w.writestr(info.filename, z.read(info))
                with open(os.path.join(out, "zip", f"{name}-p{proto}-pyzip.bin"), "wb") as f:
                    f.write(again.getvalue())


if __name__ == "__main__":
    main(sys.argv[1])
