"""One rank of a coverage job (torchrun, gloo, CPU): every architecture of the plan, one after
the other, in the same order on every rank, so that process start-up is paid once.

Causal LMs, masked-LM encoders and encoder-decoders alike (an encoder-decoder's forward gets
decoder_input_ids, and its logits are the decoder's).

For each entry and case (fsdp2: fully_shard on the _no_split_modules classes and the root;
fsdp1: FullyShardedDataParallel with ModuleWrapPolicy of those classes and
reshard.fsdp1_param_init_fn) every rank builds reshard.empty_model(OUT), shards it,
materialises it on the CPU and calls reshard.load; then it compares with from_pretrained(SRC)
in the dtype the checkpoint was built in: every parameter (full tensor: dtype, shape, bits),
every buffer (persistent or not: dtype, shape, bits), tied parameters still tied, and the logits
of a fixed batch (bits).

Collectives stay in step whatever fails: the ranks exchange their outcome after the load and
before each comparison that communicates (full_tensor / summon_full_params, the forward), and
the per-rank results are gathered to rank 0 after every entry, which appends one JSON line per
entry and case to the results file. A watchdog ends the process when one entry runs past its
time limit (a marker file names it; the parent, matrix.py, records it and starts the job again
with the entries left).
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

STATUS_ORDER = ("pass", "fsdp-refuses", "refused", "mismatch", "crash")
# The running case's results file and key: rank 0 writes a "compared" event there before the
# sharded forward, so that a process killed in the forward (a signal: no record) still tells
# matrix.py what was compared (see matrix.run_job).
EVENTS: Dict[str, Any] = {}
# Messages of torch's FSDP refusing a model (FSDP2's lazy init, FSDP1's flattening).
FSDP_REFUSALS = ("FSDP expects uniform original parameter dtype", "Must flatten tensors with uniform",
                 "FSDP does not support wrapping such modules")


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().cpu().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t


def same(a: torch.Tensor, b: torch.Tensor) -> Optional[str]:
    """None when a and b are the same tensor value (dtype, shape, bits), else how they differ."""
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    if tuple(a.shape) != tuple(b.shape):
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if torch.equal(bits(a), bits(b)):
        return None
    if a.is_floating_point():
        d = (a.double() - b.double()).abs()
        d = d[torch.isfinite(d)]
        n = int((bits(a).view(-1) != bits(b).view(-1)).sum()) if a.element_size() == 1 else None
        return f"values differ (max abs {float(d.max()) if d.numel() else float('nan'):.3g}" + \
            (f", {n} bytes" if n is not None else "") + ")"
    return f"values differ ({int((a != b).sum())} of {a.numel()} elements)"


def _token_ids(config) -> set:
    ids = set()

    def visit(d):
        for k, v in d.items():
            if isinstance(v, dict):
                visit(v)
            elif isinstance(v, bool):
                continue
            elif str(k).endswith(("token_id", "token_index", "_token_ids")):
                for x in v if isinstance(v, list) else [v]:
                    if isinstance(x, int):
                        ids.add(x)
    visit(config.to_dict())
    return ids


def fixed_batch(config) -> torch.Tensor:
    """2 x 16 token ids from a fixed generator, avoiding every special token id of the config
    (image / audio placeholders would ask for inputs the batch does not have)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None) or 128
    special = _token_ids(config)
    allowed = torch.tensor([i for i in range(vocab) if i not in special] or [0])
    rows = 2 * (getattr(config, "num_codebooks", None) or 1)
    g = torch.Generator().manual_seed(1234)
    return allowed[torch.randint(0, len(allowed), (rows, 16), generator=g)]


def logits_of(out) -> torch.Tensor:
    if hasattr(out, "logits") and out.logits is not None:
        return out.logits
    return out[0]


class Watchdog:
    """Ends the process (exit 124) when the current entry runs past its limit; a marker file
    names the entry for the parent."""

    def __init__(self, marker: str, limit: float):
        self.marker, self.limit = marker, limit
        self.current: Optional[str] = None
        self.started = 0.0
        threading.Thread(target=self._watch, daemon=True).start()

    def start(self, what: str) -> None:
        self.current, self.started = what, time.time()

    def stop(self) -> None:
        self.current = None

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            what = self.current
            if what is not None and time.time() - self.started > self.limit:
                with open(self.marker, "w") as f:
                    json.dump({"key": what, "limit_s": self.limit}, f)
                sys.stderr.write(f"coverage worker: {what} ran past {self.limit:.0f} s; exiting\n")
                sys.stderr.flush()
                os._exit(124)


def agree(local: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every rank's dict, on every rank."""
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return gathered


def error_record(e: BaseException, stage: str) -> Dict[str, Any]:
    import reshard

    if isinstance(e, reshard.ReshardError):
        return {"status": "refused", "stage": stage, "error_class": type(e).__name__, "message": str(e)}
    if stage in ("shard", "forward") and any(m in str(e) for m in FSDP_REFUSALS):
        # FSDP's own refusal of the model as from_pretrained builds it (before reshard takes
        # part, or at FSDP's lazy init in the first forward): no wrapping fixes it.
        return {"status": "fsdp-refuses", "stage": stage, "error_class": type(e).__name__,
                "message": str(e)[:600]}
    message = str(e)
    if not message.strip():  # StopIteration, a bare assert: where it was raised
        frames = traceback.extract_tb(e.__traceback__)
        if frames:
            f = frames[-1]
            message = f"raised at {os.path.basename(os.path.dirname(f.filename))}/{os.path.basename(f.filename)}:" \
                      f"{f.lineno} in {f.name}: {(f.line or '').strip()}"
    return {"status": "crash", "stage": stage, "error_class": type(e).__name__, "message": message[:2000],
            "traceback": traceback.format_exc()[-2500:]}


def no_split_modules(model, wrap: str):
    """The modules fully_shard / FSDP1 wraps besides the root, children before parents
    (fully_shard must see a nested unit before the unit around it)."""
    if wrap == "root":
        return []
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in reversed(list(model.modules())) if type(m).__name__ in names and m is not model]


def off_dtype_modules(model) -> List[Any]:
    """Modules whose own parameters are all of a floating dtype other than the model's main
    one (from_pretrained's keep-in-fp32 modules): a fully_shard group cannot mix dtypes, so a
    user shards them as units of their own; children before parents."""
    from collections import Counter

    counts = Counter(p.dtype for p in model.parameters() if p.is_floating_point())
    main = counts.most_common(1)[0][0] if counts else None
    out = []
    for m in reversed(list(model.modules())):
        own = [p for p in m.parameters(recurse=False) if p.is_floating_point()]
        if m is not model and own and all(p.dtype != main for p in own):
            out.append(m)
    return out


def shard_fsdp2(model, mesh, wrap: str, empty: bool = True):
    """fully_shard on the units (no_split_modules, off_dtype_modules), then the root; `empty`:
    to_empty after (a meta model), else the values stay (from_pretrained's own model)."""
    from torch.distributed.fsdp import fully_shard

    units = set(map(id, no_split_modules(model, wrap) + off_dtype_modules(model)))
    for m in reversed(list(model.modules())):
        if id(m) in units and m is not model:
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if empty:
        model.to_empty(device="cpu")
    return model


def shard_fsdp1(model, wrap: str, needs: Dict[str, Any], meta: bool = True):
    """FSDP1 units: the _no_split_modules classes, or the classes the build found the model
    needs (tiny.fsdp1_needs: keep-in-fp32 modules in units of their own), with
    use_orig_params where frozen and trainable parameters would share a unit; the same
    arguments went to reshard convert (matrix.layout_args)."""
    import reshard
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    names = set(needs.get("wrap") or []) if wrap != "root" and needs.get("wrap") else None
    if names is None:
        classes = {type(m) for m in no_split_modules(model, wrap)}
    else:
        classes = {type(m) for m in model.modules() if type(m).__name__ in names and m is not model}
    init = {"param_init_fn": reshard.fsdp1_param_init_fn(torch.device("cpu"))} if meta else {}
    return FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy(classes),
                use_orig_params=bool(needs.get("use_orig_params")), **init)


def plain_fsdp_failure(ref, entry: Dict[str, Any], case: str, mesh, wrap: str, kwargs: Dict[str, Any],
                       error: Dict[str, Any]) -> Tuple[Optional[str], str]:
    """After the FSDP forward of the loaded model failed on every rank: a new from_pretrained
    model of the checkpoint (`ref` gives its config) under the same FSDP units (FSDP1's, or
    fully_shard's on the same modules and mesh) and the same batch, no reshard involved. (the
    message when it fails the same way: FSDP's own limit, else None; what it did). Collective:
    every rank calls it."""
    import transformers

    try:
        # A fresh one: a forward may change the model (Switch's router casts its classifier).
        fresh = getattr(transformers, entry["model_class"]).from_pretrained(entry["src"])
        plain = shard_fsdp1(fresh, wrap, entry.get("fsdp1") or {}, meta=False) if case == "fsdp1" else \
            shard_fsdp2(fresh, mesh, wrap, empty=False)
        plain.eval()
        set_language(plain, ref.config)
        with torch.no_grad():
            plain(**kwargs)
    except Exception as e:
        mine = error_record(e, "forward")
        if type(e).__name__ == error.get("error_class") and mine.get("message") == error.get("message"):
            return mine["message"], "fails the same way"
        return None, f"fails otherwise: {type(e).__name__}: {mine.get('message')}"[:400]
    return None, "runs"


def full_parameters(model, case: str):
    """Every parameter (by clean name, aliases of a tied parameter included) as a whole tensor,
    and the groups of names that share one parameter. Collective: every rank calls it at the
    same point."""
    from reshard.model import clean_name

    out: Dict[str, torch.Tensor] = {}
    groups: Dict[int, List[str]] = {}
    if case == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model, writeback=False):
            for n, p in model.named_parameters(remove_duplicate=False):
                n = clean_name(n)
                groups.setdefault(id(p), []).append(n)
                out[n] = p.detach().clone()
        return out, ties(groups)
    from torch.distributed.tensor import DTensor

    seen: Dict[int, torch.Tensor] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen[id(p)] = p.full_tensor().detach() if isinstance(p, DTensor) else p.detach()
        groups.setdefault(id(p), []).append(n)
        out[n] = seen[id(p)]
    return out, ties(groups)


def ties(groups: Dict[int, List[str]]) -> List[List[str]]:
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def reference_parameters(ref):
    groups: Dict[int, List[str]] = {}
    out = {}
    for n, p in ref.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(n)
        out[n] = p.detach()
    return out, ties(groups)


def compare_tensors(what: str, got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor],
                    differ: List[str], aliases: Optional[List[List[str]]] = None) -> int:
    """Appends to `differ` what is missing, extra or different; a name missing from `got` is
    fine when a name tied to it in the reference is there (FSDP1 may list one of them)."""
    alias_of = {n: g for g in aliases or [] for n in g}
    for n in sorted(set(want) - set(got)):
        if not any(a in got for a in alias_of.get(n, [])):
            differ.append(f"{what} {n}: missing from the loaded model")
    for n in sorted(set(got) - set(want)):
        differ.append(f"{what} {n}: not in from_pretrained's model")
    checked = 0
    for n in sorted(set(got) & set(want)):
        why = same(got[n], want[n])
        checked += 1
        if why:
            differ.append(f"{what} {n}: {why}")
    return checked


def forward_kwargs(model, ids) -> Dict[str, Any]:
    """The call both models get: no cache (some configs lack what a cache needs), and for an
    encoder-decoder decoder_input_ids."""
    import inspect

    params = inspect.signature(model.forward).parameters
    kw: Dict[str, Any] = {"input_ids": ids}
    if "use_cache" in params:
        kw["use_cache"] = False
    if getattr(model.config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        # An encoder-decoder: the encoder reads the batch, the decoder (self- and
        # cross-attention) reads the first half of each row; the logits are the decoder's.
        kw["decoder_input_ids"] = ids[:, : ids.shape[1] // 2].clone()
    return kw


def set_language(model, config) -> None:
    fn = getattr(model, "set_default_language", None)
    if fn is not None:
        fn(getattr(config, "default_language", None) or list(getattr(config, "languages", ["en_XX"]))[0])


def run_case(entry: Dict[str, Any], case: str, mesh, wrap: str = "no_split") -> Dict[str, Any]:
    """One entry under one case, on this rank; collectives in step with the other ranks.
    wrap: "no_split" (units of the _no_split_modules classes, then the root) or "root"."""
    import transformers

    import reshard
    from reshard.model import clean_name

    rec: Dict[str, Any] = {"status": "pass"}
    t0 = time.time()
    model = None
    split: List[set] = []
    stage = "empty_model"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = reshard.empty_model(entry["out"])
            built = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point()})
            stage = "shard"
            model = shard_fsdp1(model, wrap, entry.get("fsdp1") or {}) if case == "fsdp1" else \
                shard_fsdp2(model, mesh, wrap)
            stage = "load"
            report = reshard.load(model, entry["out"])
        rec["load"] = {"bytes": report.bytes, "layout": report.layout, "tensors": report.tensors,
                       "buffers_restored": len(report.buffers_restored),
                       "converted_tensors": report.converted_tensors}
        split = [set(x.split(" = ")) for x in getattr(report, "untied", [])]
        if split:
            rec["ties_split_by_sharding"] = getattr(report, "untied")
        notes = [str(w.message) for w in caught if "reshard" in (w.filename or "")]
        if notes:
            rec["warnings"] = notes[:4]
        rec["built_dtypes"] = built
    except Exception as e:
        rec = error_record(e, stage)
    rec["load_s"] = round(time.time() - t0, 2)
    outcomes = agree({"status": rec["status"]})
    if any(o["status"] != "pass" for o in outcomes):
        return rec

    # The independent reference: transformers' own load of the checkpoint, with its default
    # dtype ("auto": the config's), which reshard.empty_model(OUT) builds in too. No collectives.
    ref = None
    try:
        cls = getattr(transformers, entry["model_class"])
        ref = cls.from_pretrained(entry["src"])
        ref.eval()
        rec["reference_dtypes"] = sorted({str(p.dtype) for p in ref.parameters() if p.is_floating_point()})
    except Exception as e:
        rec = error_record(e, "reference")
        rec["status"] = "crash"
        rec["message"] = "from_pretrained failed: " + rec["message"]
    if any(o["status"] != "pass" for o in agree({"status": rec["status"]})):
        return rec

    differ: List[str] = []
    try:
        got, got_ties = full_parameters(model, case)
        want, want_ties = reference_parameters(ref)
        rec["params_checked"] = compare_tensors("parameter", got, want, differ, want_ties)
        del got
        got_b = {clean_name(n): b for n, b in model.named_buffers(remove_duplicate=False)}
        want_b = dict(ref.named_buffers(remove_duplicate=False))
        rec["buffers_checked"] = compare_tensors("buffer", got_b, want_b, differ)
        for g in want_ties:
            if any(set(g) <= set(h) for h in got_ties):
                continue
            # Two parameters already before the load (the sharding's units split them;
            # reshard.load filled both from one entry and warned): FSDP's doing, noted.
            if any(pair <= set(g) for pair in split):
                continue
            differ.append(f"tie {' = '.join(g)}: not one parameter in the loaded model")
    except Exception as e:
        rec = error_record(e, "compare")
        rec["status"] = "crash"
    if any(o["status"] != "pass" for o in agree({"status": rec["status"]})):
        return rec

    # reshard's own --check-weights on the same model (collective): it must agree with the
    # comparison above.
    try:
        reshard.check_weights(model, entry["src"], model_class=getattr(transformers, entry["model_class"]),
                              log=lambda msg: None)
        rec["check_weights"] = "ok"
    except Exception as e:
        rec["check_weights"] = f"fails: {type(e).__name__}: {e}"[:400]

    if EVENTS.get("results") and dist.get_rank() == 0:
        with open(EVENTS["results"], "a") as f:
            f.write(json.dumps({"event": "compared", "id": EVENTS["id"], "case": EVENTS["case"],
                                "params_checked": rec.get("params_checked"),
                                "buffers_checked": rec.get("buffers_checked"), "n_differ": len(differ),
                                "check_weights": rec.get("check_weights")}) + "\n")

    # Logits: the reference's forward first (local), then the sharded model's (collective).
    ids = fixed_batch(ref.config)
    ref_logits = None
    kwargs: Dict[str, Any] = {}
    try:
        set_language(ref, ref.config)
        kwargs = forward_kwargs(ref, ids)
        with torch.no_grad():
            ref_logits = logits_of(ref(**kwargs))
    except Exception as e:
        rec["logits"] = f"not compared: from_pretrained's own model fails on the batch: {type(e).__name__}: {e}"[:400]
    ok = agree({"ref": ref_logits is not None})
    if all(o["ref"] for o in ok):
        crashed = False
        try:
            model.eval()
            set_language(model, ref.config)
            with torch.no_grad():
                logits = logits_of(model(**kwargs))
            why = same(logits, ref_logits)
            if why:
                differ.append(f"logits: {why}")
            rec["logits"] = "equal" + ("" if bool(torch.isfinite(ref_logits.float()).all()) else " (not all finite)")
        except Exception as e:
            # What was compared before the forward stays in the record: a crash in the forward
            # does not hide a parameter or buffer that differs (that is a mismatch still).
            checked = {k: rec[k] for k in ("params_checked", "buffers_checked", "check_weights", "load")
                       if k in rec}
            rec = dict(error_record(e, "forward"), **checked)
            if rec["status"] == "refused":  # a ReshardError in a forward is reshard's fault
                rec["status"] = "crash"
            if differ:
                rec["status"] = "mismatch"
            crashed = rec["status"] == "crash"
        # An FSDP forward that fails on every rank after every parameter and buffer compared
        # equal: is it FSDP's own limit? from_pretrained's model under the same units tells.
        if all(o["crashed"] for o in agree({"crashed": crashed})):
            same_failure, rec["plain_fsdp_forward"] = plain_fsdp_failure(ref, entry, case, mesh, wrap, kwargs, rec)
            if same_failure is not None:
                rec["status"] = "fsdp-refuses"
                rec["message"] = (f"{'FSDP1' if case == 'fsdp1' else 'FSDP2'} fails the same way on "
                                  "from_pretrained's own model under the same units, without reshard: "
                                  f"{rec['message']}")[:2000]
    elif "logits" not in rec:
        rec["logits"] = "not compared: from_pretrained's own model fails on the batch on another rank"
    if differ and rec["status"] in ("pass", "mismatch"):
        rec["status"] = "mismatch"
        rec["differ"] = differ[:40]
        rec["n_differ"] = len(differ)
    del model, ref
    return rec


def guarded(entry: Dict[str, Any], case: str, mesh, wrap: str) -> Dict[str, Any]:
    try:
        return run_case(entry, case, mesh, wrap)
    except Exception as e:  # the worker itself; still in step (no collective after)
        rec = error_record(e, "worker")
        rec["status"] = "crash"
        return rec


def combine(entry: Dict[str, Any], case: str, world: int, per_rank: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One record from every rank's: the worst status; a refusal's message (and which ranks
    refused when not all did); mismatches as the union of what differed."""
    worst = max(per_rank, key=lambda r: STATUS_ORDER.index(r["status"]))
    out = {"id": entry["id"], "case": f"{case}-ws{world}", "status": worst["status"]}
    for k in ("stage", "error_class", "message", "traceback", "logits", "load", "params_checked",
              "buffers_checked", "warnings", "built_dtypes", "reference_dtypes", "ties_split_by_sharding",
              "check_weights", "plain_fsdp_forward"):
        if k in worst:
            out[k] = worst[k]
    bad = [i for i, r in enumerate(per_rank) if r["status"] == worst["status"]]
    if worst["status"] != "pass" and len(bad) != len(per_rank):
        out["ranks"] = bad
        others = sorted({r["status"] for r in per_rank if r["status"] != worst["status"]})
        out["other_ranks"] = others
    if worst["status"] == "mismatch":
        differ: List[str] = []
        for r in per_rank:
            differ += [d for d in r.get("differ", []) if d not in differ]
        out["differ"] = differ[:40]
        out["n_differ"] = max(r.get("n_differ", 0) for r in per_rank)
    out["load_s"] = max(r.get("load_s", 0) for r in per_rank)
    return out


def plain_forward(plan: Dict[str, Any], which: str) -> int:
    """--plain: from_pretrained's own model of an entry under a case's FSDP units (as
    plain_fsdp_failure builds it), the fixed batch once; a crash in it kills the process as it
    killed the reshard job's."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    entry_id, _, case = which.rpartition(":")
    entry = next(e for e in plan["entries"] if e["id"] == entry_id)
    dist.init_process_group("gloo")
    faulthandler.enable(file=open(f"{plan['results']}.plain-fault.{dist.get_rank()}", "w"))  # noqa: SIM115
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ref = getattr(transformers, entry["model_class"]).from_pretrained(entry["src"])
    kwargs = forward_kwargs(ref, fixed_batch(ref.config))
    err = {"error_class": None, "message": None}
    plain_fsdp_failure(ref, entry, case, mesh, "no_split", kwargs, err)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True, help="JSON: entries, cases, results file, time limit")
    ap.add_argument("--plain", default="",
                    help="ENTRY_ID:CASE of the plan: from_pretrained's own model under that case's units runs the "
                         "fixed batch, no reshard (exits 0 when it runs; a process killed by a signal dies)")
    args = ap.parse_args()
    with open(args.plan) as f:
        plan = json.load(f)
    if args.plain:
        return plain_forward(plan, args.plain)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    faulthandler.enable()  # a fatal signal's Python stack goes to the job log
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # Each rank's fatal-signal stack in a file of its own (in the shared job log, the ranks'
    # lines interleave): matrix.fault_report reads them.
    faulthandler.enable(file=open(f"{plan['results']}.fault.{rank}", "w"))  # noqa: SIM115 -- for the process's life
    mesh = init_device_mesh("cpu", (world,))
    dog = Watchdog(f"{plan['results']}.timeout.{rank}", plan["limit_s"])
    n = sum(len(e["cases"]) for e in plan["entries"])
    i = 0
    for entry in plan["entries"]:
        for case in entry["cases"]:
            i += 1
            key = f"{entry['id']} {case}-ws{world}"
            if rank == 0:
                with open(plan["results"], "a") as f:
                    f.write(json.dumps({"event": "start", "id": entry["id"], "case": f"{case}-ws{world}"}) + "\n")
            EVENTS.update(results=plan["results"], id=entry["id"], case=f"{case}-ws{world}")
            dog.start(key)
            t0 = time.time()
            per_rank = agree(guarded(entry, case, mesh, "no_split"))
            fallback = None
            if case == "fsdp2" and any(r["status"] == "crash" and r.get("stage") == "shard" for r in per_rank):
                # fully_shard itself failed on the model's units (before reshard took part):
                # what does the root alone give?
                gc.collect()
                fallback = combine(entry, case, world, agree(guarded(entry, case, mesh, "root")))
            dog.stop()
            if rank == 0:
                out = combine(entry, case, world, per_rank)
                if fallback is not None:
                    out["root_only"] = {k: fallback[k] for k in ("status", "stage", "message", "differ", "logits")
                                        if k in fallback}
                out["seconds"] = round(time.time() - t0, 2)
                out["fingerprint"] = plan["fingerprint"]
                with open(plan["results"], "a") as f:
                    f.write(json.dumps(out, default=str) + "\n")
                detail = out.get("message") or "; ".join(out.get("differ", [])[:2]) or out.get("logits", "")
                print(f"[{i}/{n}] {key:40s} {out['status']:8s} {out['seconds']:6.1f}s {detail[:150]}", flush=True)
            gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
