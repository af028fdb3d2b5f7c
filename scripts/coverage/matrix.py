#!/usr/bin/env python
"""The architecture coverage matrix: which transformers architectures reshard converts and
loads exactly, under FSDP2 at world sizes 2 and 3 and FSDP1 at 2.

    export PYTHONPATH=$PWD/python RESHARD_BIN=$PWD/build/reshard
    .venv/bin/python scripts/coverage/matrix.py                    # every causal-LM type
    .venv/bin/python scripts/coverage/matrix.py llama mixtral@fp16  # some entries only
    .venv/bin/python scripts/coverage/matrix.py --task masked-lm     # every text encoder (MLM head)
    .venv/bin/python scripts/coverage/matrix.py --task seq2seq-lm    # every text encoder-decoder
    .venv/bin/python scripts/coverage/matrix.py --task seq2seq-lm --merge t5 bart  # rerun two, merged

For every entry (a model type; `TYPE@fp16`, `TYPE@bin-fp16`, ... for the fp16 and .bin
variants of the families that ship them, tiny.FP16_FAMILIES / tiny.BIN_FAMILIES):

1. build a tiny model from its config class's defaults (scripts/coverage/tiny.py), seeded
   random parameters, save_pretrained (or torch.save for .bin) into CACHE/<id>/src, and capture
   the FSDP1 model manifest (reshard.model_manifest);
2. convert it with the CLI ($RESHARD_BIN): --world-size 2 and 3, and --layout fsdp1
   --world-size 2 (OUT/reshard-model.json), into CACHE/<id>/out;
3. one torchrun job per world size (gloo, CPU) runs scripts/coverage/worker.py over all
   entries: reshard.empty_model(OUT), shard, to_empty, reshard.load, and compare every
   parameter, buffer, tie and the logits of a fixed batch with from_pretrained(SRC).

Tasks (--task): causal-lm (AutoModelForCausalLM's mapping), masked-lm (AutoModelForMaskedLM's:
the encoders) and seq2seq-lm (AutoModelForSeq2SeqLM's: the encoder-decoders, whose forward gets
decoder_input_ids); the encoder and encoder-decoder tasks leave out the multimodal / speech
classes (tiny.excluded, listed in the doc with the reason). Each task's records go to
scripts/coverage/results/<task>.json; docs/coverage.md is generated from all of them, a section
per family.

Each case ends as pass, refused (a ReshardError from convert or load: its message), mismatch
(a load that succeeded but differs: which tensors), crash (any other exception, or the case ran
past --limit-s) or skipped (the tiny model could not be built: why). The records go to
--json (default scripts/coverage/results/<task>.json) and the table to --doc (default
docs/coverage.md).

Reruns are cheap: checkpoints are rebuilt only when tiny.py or transformers change,
conversions only when the CLI binary or the checkpoint changes, and load results are reused
while the CLI, the reshard package, the worker and the checkpoint are the same (--force
reruns the loads). Progress is printed as it goes.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)

import tiny  # noqa: E402

STATUSES = ("pass", "fsdp-refuses", "refused", "mismatch", "crash", "skipped")
DEFAULT_CACHE = os.path.join(REPO, ".work", "coverage")


def log(msg: str) -> None:
    print(msg, flush=True)


def file_digest(paths: List[str]) -> str:
    h = hashlib.sha1()
    for path in paths:
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def reshard_bin() -> str:
    return os.environ.get("RESHARD_BIN", os.path.join(REPO, "build", "reshard"))


def package_dir() -> str:
    import reshard

    return os.path.dirname(os.path.abspath(reshard.__file__))


def load_fingerprint() -> str:
    """What a load result depends on besides the checkpoint: the CLI, the package (Python and
    extension), the worker."""
    pkg = package_dir()
    files = sorted(glob.glob(os.path.join(pkg, "*.py")) + glob.glob(os.path.join(pkg, "_C*.so")))
    return tiny.build_fingerprint() + "-" + file_digest([reshard_bin(), os.path.join(HERE, "worker.py")] + files)


def short(text: str, cache: str, n: int = 0) -> str:
    """A message with the cache's paths replaced by SRC / OUT placeholders."""
    text = text.replace(os.path.join(cache, ""), "<cache>/")
    return text if not n or len(text) <= n else text[:n - 3] + "..."


# -- conversions -----------------------------------------------------------------------------

LAYOUTS = {  # case -> the convert arguments that make its layout
    "fsdp2-ws2": ["--world-size", "2"],
    "fsdp2-ws3": ["--world-size", "3"],
    "fsdp1-ws2": ["--world-size", "2", "--layout", "fsdp1"],
}


def layout_args(build: Dict[str, Any], case: str) -> List[str]:
    """The convert arguments of a case, with the FSDP1 units and use_orig_params the model
    needs (tiny.fsdp1_needs)."""
    args = list(LAYOUTS[case])
    needs = build.get("fsdp1") or {}
    if case.startswith("fsdp1"):
        for cls in needs.get("wrap") or []:
            args += ["--wrap", cls]
        if needs.get("use_orig_params"):
            args.append("--use-orig-params")
    return args


def convert(build: Dict[str, Any], cache: str, cases: List[str]) -> Dict[str, Dict[str, Any]]:
    """Converts the entry's checkpoint for every case; returns {case: refusal/crash record} for
    the conversions that failed (the others are ready to load). Cached by a stamp naming the
    CLI and the checkpoint."""
    entry_dir = os.path.join(cache, build["id"])
    out = os.path.join(entry_dir, "out")
    stamp_path = os.path.join(entry_dir, "convert.json")
    stamp = {"bin": file_digest([reshard_bin()]), "build": build.get("fingerprint"),
             "manifest": file_digest([os.path.join(entry_dir, "reshard-model.json")])}
    done: Dict[str, Any] = {}
    if os.path.exists(stamp_path):
        with open(stamp_path) as f:
            old = json.load(f)
        if old.get("stamp") == stamp:
            done = old.get("cases", {})
        else:
            shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    shutil.copyfile(os.path.join(entry_dir, "reshard-model.json"), os.path.join(out, "reshard-model.json"))
    failed = {}
    for case in cases:
        if case not in done:
            t0 = time.time()
            p = subprocess.run([reshard_bin(), "convert", build["src"], "-o", out, *layout_args(build, case)],
                               capture_output=True, text=True)
            done[case] = {"rc": p.returncode, "stderr": (p.stderr or p.stdout)[-3000:],
                          "seconds": round(time.time() - t0, 2)}
        r = done[case]
        if r["rc"] != 0:
            message = r["stderr"].strip()
            status = "refused" if 0 < r["rc"] < 128 and message else "crash"
            failed[case] = {"id": build["id"], "case": case, "status": status, "stage": "convert",
                            "message": f"reshard convert exited {r['rc']}: {message}"}
    with open(stamp_path, "w") as f:
        json.dump({"stamp": stamp, "cases": done}, f, indent=1)
    return failed


# -- the torchrun jobs -----------------------------------------------------------------------

def read_jsonl(path: str) -> List[Dict[str, Any]]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut by a killed job
    return out


def run_job(world: int, entries: List[Dict[str, Any]], results: str, limit_s: float, fingerprint: str,
            job_log: str) -> None:
    """Runs the worker under torchrun over `entries` (each with its cases) until every case has a
    record in `results`; a job that dies (a case past its limit, a crashed process) is recorded
    against the case it was in, and started again with what is left."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=os.pathsep.join([os.path.dirname(package_dir())] +
                                          [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    attempts = 0
    while True:
        have = {(r["id"], r["case"]) for r in read_jsonl(results) if r.get("fingerprint") == fingerprint
                and "status" in r}
        todo = []
        for e in entries:
            cases = [c for c in e["cases"] if (e["id"], f"{c}-ws{world}") not in have]
            if cases:
                todo.append(dict(e, cases=cases))
        if not todo:
            return
        attempts += 1
        if attempts > len(entries) * 3 + 3:
            raise RuntimeError(f"world size {world}: the job keeps failing; see {job_log}")
        plan_path = f"{results}.plan-ws{world}.json"
        with open(plan_path, "w") as f:
            json.dump({"entries": todo, "results": results, "limit_s": limit_s, "fingerprint": fingerprint}, f)
        for marker in glob.glob(f"{results}.timeout.*") + glob.glob(f"{results}.fault.*") + \
                glob.glob(f"{results}.plain-fault.*"):
            os.remove(marker)
        n_cases = sum(len(e["cases"]) for e in todo)
        log(f"== torchrun --nproc-per-node {world}: {len(todo)} entries, {n_cases} cases (log: {job_log})")
        before = len(read_jsonl(results))
        log_offset = os.path.getsize(job_log) if os.path.exists(job_log) else 0
        with open(job_log, "a") as err:
            p = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", str(world),
                                  os.path.join(HERE, "worker.py"), "--plan", plan_path],
                                 env=env, stderr=err, start_new_session=True)
            try:
                rc = p.wait(timeout=limit_s * n_cases + 600)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)  # the job this function started (its own session)
                rc = p.wait()
        lines = read_jsonl(results)[before:]
        if rc == 0:
            continue
        # The case that was running when the job died: the last start without a result.
        started = [r for r in lines if r.get("event") == "start"]
        finished = {(r["id"], r["case"]) for r in lines if "status" in r}
        running = next((s for s in reversed(started) if (s["id"], s["case"]) not in finished), None)
        if running is None:
            raise RuntimeError(f"world size {world}: torchrun exited {rc} before any case; see {job_log}")
        markers = glob.glob(f"{results}.timeout.*")
        if markers:
            message = f"ran past the {limit_s:.0f} s limit per case (the job was stopped)"
            error_class = "Timeout"
        else:
            fatal = fault_report(f"{results}.fault", world) or fatal_error(job_log, log_offset)
            message = f"the job died during this case (torchrun exit {rc}){fatal}"
            error_class = "ProcessDied"
        rec = {"id": running["id"], "case": running["case"], "status": "crash", "stage": "process",
               "error_class": error_class, "message": message}
        # Killed in the sharded forward after everything compared equal: does from_pretrained's
        # own model under the same units die the same way? Then it is FSDP's limit, not reshard's.
        compared = next((r for r in reversed(lines) if r.get("event") == "compared" and
                         (r["id"], r["case"]) == (running["id"], running["case"])), None)
        if error_class == "ProcessDied" and compared is not None and compared.get("n_differ") == 0:
            rec.update(stage="forward", params_checked=compared.get("params_checked"),
                       buffers_checked=compared.get("buffers_checked"), check_weights=compared.get("check_weights"))
            plain_rc, plain_fatal = run_plain(torchrun, env, world, plan_path, results, running, limit_s, job_log)
            rec["plain_fsdp_forward"] = "runs" if plain_rc == 0 else f"dies (torchrun exit {plain_rc}){plain_fatal}"
            if plain_rc != 0 and plain_fatal and plain_fatal == fault_report(f"{results}.fault", world):
                kind = running["case"].split("-ws")[0].upper()
                rec.update(status="fsdp-refuses", message=f"{kind} dies the same way on from_pretrained's own "
                           f"model under the same units, without reshard (torchrun exit {rc}){plain_fatal}")
        with open(results, "a") as f:
            f.write(json.dumps(dict(rec, fingerprint=fingerprint)) + "\n")
        log(f"   {running['id']} {running['case']}: {rec['status']}: {rec['message']}")


def run_plain(torchrun: str, env: Dict[str, str], world: int, plan_path: str, results: str,
              running: Dict[str, Any], limit_s: float, job_log: str) -> Tuple[int, str]:
    """worker.py --plain for the case that killed the job: (torchrun's exit code, what
    faulthandler wrote for it: fault_report's text)."""
    case = running["case"].split("-ws")[0]
    with open(job_log, "a") as err:
        err.write(f"== plain from_pretrained forward of {running['id']} {running['case']}\n")
        err.flush()
        p = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", str(world), os.path.join(HERE, "worker.py"),
                              "--plan", plan_path, "--plain", f"{running['id']}:{case}"],
                             env=env, stdout=err, stderr=err, start_new_session=True)
        try:
            rc = p.wait(timeout=limit_s + 300)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            rc = p.wait()
    return rc, fault_report(f"{results}.plain-fault", world) if rc else ""


def fault_report(prefix: str, world: int) -> str:
    """What faulthandler wrote for the first rank killed by a signal (worker.py gives each rank
    PREFIX.RANK): ": <the error> in <the innermost frames of the thread that had it>"; "" when
    no rank wrote one."""
    for r in range(world):
        try:
            with open(f"{prefix}.{r}", errors="replace") as f:
                text = fatal_text(f.read().splitlines())
        except OSError:
            continue
        if text:
            return text
    return ""


def fatal_error(job_log: str, offset: int) -> str:
    """What faulthandler wrote for a process killed by a signal, from byte `offset` of the job
    log: fatal_text's, or "; see the job log" when nothing was written."""
    with open(job_log, errors="replace") as f:
        f.seek(offset)
        return fatal_text(f.read().splitlines()) or "; see the job log"


def fatal_text(lines: List[str]) -> str:
    """faulthandler's output in `lines`: ": <the error> in <the innermost frames of the thread
    that had it>" ("" when there is none)."""
    fatal = next((x.strip() for x in lines if x.startswith("Fatal Python error")), None)
    if fatal is None:
        return ""
    for i, line in enumerate(lines):
        if line.startswith("Current thread"):
            frames = []
            for x in lines[i + 1:i + 12]:
                x = x.strip()
                if not x.startswith("File "):
                    break
                frames.append(x.replace(os.path.dirname(os.path.dirname(os.__file__)), "..."))
            return f": {fatal} in " + " <- ".join(frames[:4])
    return f": {fatal}"


# -- the whole run ---------------------------------------------------------------------------

def prepare(ids: List[str], cache: str, task: str, cases: List[str], limit_s: float) -> Dict[str, Any]:
    """Builds and converts a task's entries (in CACHE/<task> for a task other than causal-lm:
    a type of two tasks, bert, is two checkpoints): the entries, builds, records of what
    failed before a load, and the entries to load."""
    if task != "causal-lm":
        cache = os.path.join(cache, task)
    os.makedirs(cache, exist_ok=True)
    entries = [tiny.parse_entry_id(i) for i in ids]

    log(f"== build ({task}): {len(entries)} tiny checkpoints into {cache}")
    t0 = time.time()
    with open(os.path.join(cache, "build.log"), "a") as build_log:
        def progress(i, n, rec):
            log(f"[{i + 1}/{n}] build {rec['id']:32s} {rec['status']:12s} {rec.get('layout', '')}"
                f" {rec.get('build_s', '')}s {short(rec.get('error', ''), cache, 120)}")
        builds = tiny.build_with_timeout(entries, cache, limit_s, task, log=build_log, progress=progress)
    build_s = time.time() - t0

    log(f"== convert ({task})")
    t0 = time.time()
    records: Dict[tuple, Dict[str, Any]] = {}
    runnable: List[Dict[str, Any]] = []
    for b in builds:
        if b.get("status") != "built":
            for case in cases:
                records[(b["id"], case)] = {"id": b["id"], "case": case, "status": "skipped", "stage": "build",
                                            "message": f"tiny model not built ({b.get('stage')}): {b.get('error')}"}
            continue
        failed = convert(b, cache, cases)
        for case, rec in failed.items():
            records[(b["id"], case)] = rec
        ok = [c for c in cases if c not in failed]
        if ok:
            runnable.append({"id": b["id"], "src": b["src"], "out": os.path.join(cache, b["id"], "out"),
                             "model_class": b["model_class"], "dtype": b["dtype"], "cases": ok,
                             "fsdp1": b.get("fsdp1") or {}})
    convert_s = time.time() - t0
    log(f"   {len(runnable)} entries to load, {sum(1 for r in records.values() if r['stage'] == 'convert')} "
        f"conversions refused ({convert_s:.0f} s)")
    return {"task": task, "cache": cache, "entries": entries, "builds": builds, "records": records,
            "runnable": runnable, "build_s": build_s, "convert_s": convert_s}


def assemble(p: Dict[str, Any], lines: List[Dict[str, Any]], cases: List[str], fingerprint: str,
             prefix: str = "") -> List[Dict[str, Any]]:
    """One record per entry and case of a prepared task, from the job's result lines (ids
    under `prefix` for a task loaded in another task's jobs)."""
    by_id = {b["id"]: b for b in p["builds"]}
    records = dict(p["records"])
    for r in lines:
        if r.get("fingerprint") != fingerprint or "status" not in r or not r["id"].startswith(prefix):
            continue
        rid = r["id"][len(prefix):]
        if rid in by_id and r["case"] in cases:
            if (rid, r["case"]) in records and records[(rid, r["case"])]["stage"] == "convert":
                continue
            records[(rid, r["case"])] = dict(r, id=rid)
    out_records = []
    for e in p["entries"]:
        b = by_id[e["id"]]
        for case in cases:
            rec = dict(records.get((e["id"], case)) or {"id": e["id"], "case": case, "status": "crash",
                                                         "stage": "matrix", "message": "no result recorded"})
            rec.pop("fingerprint", None)
            rec.pop("event", None)
            if "message" in rec:
                rec["message"] = short(rec["message"], p["cache"])
            if "traceback" in rec:
                rec["traceback"] = short(rec["traceback"], p["cache"])
            rec.update(model_type=e["model_type"], dtype=e["dtype"], format=e["format"],
                       model_class=b.get("model_class"), layout=b.get("layout"))
            out_records.append(rec)
    return out_records


def builds_of(p: Dict[str, Any]) -> List[Dict[str, Any]]:
    return [{k: b.get(k) for k in ("id", "model_class", "layout", "no_split_modules", "persistent_buffers",
                                   "tied", "numel", "status", "error", "n_renamed", "n_fused")}
            for b in p["builds"]]


def run(ids: List[str], cache: str, world_sizes=(2, 3), fsdp1: bool = True, limit_s: float = 120.0,
        force: bool = False, task: str = "causal-lm", extra: Optional[List[Dict[str, Any]]] = None,
        also: Optional[Dict[str, List[str]]] = None) -> Dict[str, Any]:
    """Builds, converts and loads every entry; returns {"meta": ..., "builds": ..., "records":
    [...], "excluded": {...}}, one record per entry and case. `extra`: entries loaded in the same
    jobs without being built or converted here ({id, src, out, model_class, dtype, cases}: a
    test's controls); their records are under "extra". `also`: {task: ids} entries of other
    tasks built, converted and loaded in the same jobs (one torchrun start per world size for
    all); their results, each like this one's, are under "also"."""
    t_start = time.time()
    cases = [f"fsdp2-ws{w}" for w in world_sizes] + (["fsdp1-ws2"] if fsdp1 and 2 in world_sizes else [])
    main_p = prepare(ids, cache, task, cases, limit_s)
    others = {t: prepare(i, cache, t, cases, limit_s) for t, i in (also or {}).items()}
    runnable = list(main_p["runnable"])
    for t, p in others.items():
        runnable += [dict(r, id=f"{t}/{r['id']}") for r in p["runnable"]]
    runnable += extra or []

    fingerprint = load_fingerprint()
    results = os.path.join(main_p["cache"], f"results-{task}.jsonl")
    if force and os.path.exists(results):
        os.remove(results)
    job_seconds = {}
    for world in world_sizes:
        kinds = ["fsdp2"] + (["fsdp1"] if fsdp1 and world == 2 else [])
        entries_w = []
        for r in runnable:
            mine = [k for k in kinds if f"{k}-ws{world}" in r["cases"]]
            if mine:
                entries_w.append(dict(r, cases=mine))
        t0 = time.time()
        run_job(world, entries_w, results, limit_s, fingerprint, os.path.join(main_p["cache"], f"job-ws{world}.log"))
        job_seconds[f"ws{world}"] = round(time.time() - t0, 1)
    lines = read_jsonl(results)
    extra_ids = {e["id"] for e in extra or []}
    extra_records = [r for r in lines if r.get("fingerprint") == fingerprint and "status" in r
                     and r["id"] in extra_ids]
    main_ids = {b["id"] for b in main_p["builds"]}
    seconds = round(time.time() - t_start, 1)
    out = {"meta": meta(task, cases, seconds, main_p["build_s"], main_p["convert_s"], job_seconds),
           "builds": builds_of(main_p),
           "records": assemble(main_p, [r for r in lines if r["id"] in main_ids], cases, fingerprint),
           "extra": extra_records, "excluded": tiny.excluded(task)}
    if others:
        out["also"] = {t: {"meta": meta(t, cases, seconds, p["build_s"], p["convert_s"], job_seconds),
                           "builds": builds_of(p), "records": assemble(p, lines, cases, fingerprint, f"{t}/"),
                           "excluded": tiny.excluded(t)}
                       for t, p in others.items()}
    return out


def meta(task, cases, total_s, build_s, convert_s, job_seconds) -> Dict[str, Any]:
    import torch
    import transformers

    import reshard

    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"task": task, "cases": cases, "date": datetime.date.today().isoformat(),
            "transformers": transformers.__version__, "torch": torch.__version__,
            "reshard": reshard.__version__, "commit": commit, "seconds": round(total_s, 1),
            "build_s": round(build_s, 1), "convert_s": round(convert_s, 1), "job_s": job_seconds,
            "cpus": os.cpu_count()}


# -- the document ----------------------------------------------------------------------------

def totals(records: List[Dict[str, Any]], cases: List[str]) -> Dict[str, Dict[str, int]]:
    out = {c: {s: 0 for s in STATUSES} for c in cases}
    for r in records:
        out[r["case"]][r["status"]] += 1
    return out


def cell(r: Dict[str, Any]) -> str:
    s = r["status"]
    if s == "pass":
        notes = []
        if str(r.get("logits", "")).startswith("not compared"):
            notes.append("logits not compared")
        if r.get("ties_split_by_sharding"):
            notes.append("tie split by the FSDP units: " + ", ".join(r["ties_split_by_sharding"]))
        if str(r.get("check_weights", "ok")) != "ok":
            notes.append("**--check-weights disagrees**: " + str(r["check_weights"])[:120])
        return "pass" + (f" ({'; '.join(notes)})" if notes else "")
    if s == "mismatch":
        names = [d.split(":")[0] for d in r.get("differ", [])]
        more = r.get("n_differ", len(names)) - 3
        return "**mismatch**: " + ", ".join(names[:3]) + (f" (+{more})" if more > 0 else "")
    msg = (r.get("message") or "").splitlines()[0] if r.get("message") else ""
    if s == "refused":
        return f"refused ({r.get('stage')}): {reason(msg)}"
    if s == "fsdp-refuses":
        return f"FSDP refuses the model ({r.get('stage')}): {msg[:110]}"
    if s == "crash":
        fallback = r.get("root_only")
        equal = "; parameters and buffers equal before it" if r.get("stage") == "forward" and \
            r.get("params_checked") else ""
        return f"**crash** ({r.get('stage')}{equal}): {r.get('error_class', '')}: {msg[:100]}" + \
            (f"; root-only unit: {cell(fallback)}" if fallback else "")
    return f"skipped: {msg[:100]}"


def reason(msg: str) -> str:
    """A refusal's message, short enough for a table cell."""
    for cut in (" Is OUT converted", " Convert this model", " Create it with", " Convert for it"):
        if cut in msg:
            msg = msg[:msg.index(cut)]
    return msg[:140] + ("..." if len(msg) > 140 else "")


def md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


INTRO = (
    "Generated by `scripts/coverage/matrix.py`; do not edit by hand. Every text architecture of transformers "
    "{transformers}'s auto mappings for {families}, built as a tiny model from its config class's own defaults "
    "(scripts/coverage/tiny.py) with seeded random parameters, written with `save_pretrained` in bf16 (plus fp16 "
    "and `.bin` variants of the causal families that ship them), converted with `reshard convert` and loaded with "
    "`reshard.load` into a model built by `reshard.empty_model` and sharded by FSDP2 (`fully_shard` on the "
    "`_no_split_modules` classes, on the modules whose own parameters from_pretrained keeps in fp32, and on the "
    "root) at world sizes 2 and 3 and by FSDP1 (`FullyShardedDataParallel`, `ModuleWrapPolicy` of the same "
    "classes, with `use_orig_params` where a unit mixes frozen and trainable parameters; convert gets the same "
    "`--wrap` / `--use-orig-params`) at 2, over gloo on CPU: what FSDP itself needs to shard the model as "
    "from_pretrained builds it. A case **passes** when every parameter, every buffer (persistent or not) and the "
    "logits of a fixed batch (an encoder-decoder's decoder logits, with `decoder_input_ids`) are bit-equal to "
    "`from_pretrained` of the same checkpoint, tied parameters are still one "
    "(or were split into two by the FSDP units before the load, which the cell names: both hold the "
    "one tensor's values, and reshard.load warns), and reshard's own `--check-weights` agrees. "
    "**FSDP refuses**: torch's FSDP itself refuses the model as from_pretrained builds it (one module "
    "holding parameters of two dtypes, which no unit can flatten), before or after reshard's part, "
    "or an FSDP1 or FSDP2 forward fails after every parameter and buffer compared equal and fails the "
    "same way on from_pretrained's own model under the same units, without reshard; "
    "**refused**: convert or load raised a `ReshardError` (its message); **mismatch**: the load succeeded "
    "but something differs (a silent mismatch); **crash**: any other exception, or the case ran past "
    "the time limit; **skipped**: the tiny model could not be built here. Types a family's matrix leaves "
    "out by rule (multimodal / speech classes) are listed under it with the reason and not counted.")
MAPPING_NAMES = {"causal-lm": "`AutoModelForCausalLM`", "masked-lm": "`AutoModelForMaskedLM`",
                 "seq2seq-lm": "`AutoModelForSeq2SeqLM`"}


def figures(result: Dict[str, Any]) -> Dict[str, Any]:
    """Entries, entries passing every case, silent mismatches, totals per case."""
    cases = result["meta"]["cases"]
    by_entry: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for r in result["records"]:
        by_entry.setdefault(r["id"], {})[r["case"]] = r
    t = totals(result["records"], cases)
    return {"cases": cases, "by_entry": by_entry, "totals": t, "entries": len(by_entry),
            "all_pass": sum(1 for cs in by_entry.values() if all(cs[c]["status"] == "pass" for c in cases)),
            "silent": sum(t[c]["mismatch"] for c in cases)}


def pct(n: int, d: int) -> str:
    return f"{100.0 * n / max(d, 1):.1f} %"


def family_lines(result: Dict[str, Any], heading: bool) -> List[str]:
    m = result["meta"]
    task = m.get("task", "causal-lm")
    f = figures(result)
    cases, by_entry, t = f["cases"], f["by_entry"], f["totals"]
    n_all = f["entries"]
    variants = sum(1 for e in by_entry if "@" in e)
    lines = [f"## {tiny.FAMILIES.get(task, task)}", ""] if heading else []
    lines += [
        f"- Mapping: {MAPPING_NAMES.get(task, task)} (`{tiny.MAPPINGS.get(task, '')}`); "
        f"command: `{m.get('command', '')}`",
        f"- Date: {m['date']}; reshard {m['reshard']} (commit {m['commit']}), transformers {m['transformers']}, "
        f"torch {m['torch']}; {m['cpus']} CPUs; {m['seconds']:.0f} s in all (build {m['build_s']:.0f} s, "
        f"convert {m['convert_s']:.0f} s, loads " + ", ".join(f"{k} {v:.0f} s" for k, v in m["job_s"].items()) + ")",
        f"- Entries: {n_all} ({n_all - variants} model types"
        + (f", {variants} fp16 / .bin variants" if variants or task == "causal-lm" else "")
        + f"); **{f['all_pass']} pass every case ({pct(f['all_pass'], n_all)})**; silent mismatches: "
        f"**{f['silent']}**",
    ] + [f"- {note}" for note in ([m["note"]] if isinstance(m.get("note"), str) else m.get("note") or [])] + [
        "",
        "| case | pass | FSDP refuses | refused | mismatch | crash | skipped | pass rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        n = sum(t[c].values())
        lines.append(f"| {c} | " + " | ".join(str(t[c][s]) for s in STATUSES) + f" | {pct(t[c]['pass'], n)} |")
    lines += ["", "| architecture | model class | checkpoint layout | " + " | ".join(cases) + " |",
              "|---|---|---|" + "---|" * len(cases)]
    for eid in sorted(by_entry):
        cs = by_entry[eid]
        first = cs[cases[0]]
        lines.append(f"| {eid} | {first.get('model_class') or ''} | {first.get('layout') or '-'} | " +
                     " | ".join(md_escape(cell(cs[c])) for c in cases) + " |")
    excluded = result.get("excluded") or {}
    if excluded:
        lines += ["", f"Left out by rule ({len(excluded)}; not counted above):", ""]
        lines += [f"- {t_}: {md_escape(why)}" for t_, why in sorted(excluded.items())]
    details = []
    for eid in sorted(by_entry):
        for c in cases:
            r = by_entry[eid][c]
            if r["status"] == "pass":
                continue
            if r["status"] == "mismatch":
                text = "; ".join(r.get("differ", [])[:12]) + (" ..." if r.get("n_differ", 0) > 12 else "")
            else:
                text = (r.get("message") or "")[:600]
            details.append(f"- **{eid}** {c}: {r['status']} ({r.get('stage')}"
                           f"{', ' + r['error_class'] if r.get('error_class') else ''}"
                           f"{', ranks ' + str(r['ranks']) if r.get('ranks') else ''}): {md_escape(text)}")
    lines += ["", f"#{'##' if heading else '#'} Details" + (f" ({tiny.FAMILIES.get(task, task)})" if heading else ""),
              ""] + (details or ["Every case passes."])
    return lines


def write_doc(results, path: str, command: Optional[str] = None) -> None:
    """The table of one task's result, or of several (a list, in tiny.TASKS order): the
    figures over all of them, then a section per family."""
    if isinstance(results, dict):
        results = [dict(results, meta=dict(results["meta"], command=command or results["meta"].get("command", "")))]
    results = sorted(results, key=lambda r: tiny.TASKS.index(r["meta"].get("task", "causal-lm")))
    figs = [figures(r) for r in results]
    n_all = sum(f["entries"] for f in figs)
    all_pass = sum(f["all_pass"] for f in figs)
    silent = sum(f["silent"] for f in figs)
    tasks = [r["meta"].get("task", "causal-lm") for r in results]
    m = results[0]["meta"]
    lines = ["# Architecture coverage", "",
             INTRO.format(transformers=m["transformers"], families=", ".join(MAPPING_NAMES.get(t, t) for t in tasks)),
             ""]
    if len(results) > 1:
        lines += [f"**All families: {n_all} entries; {all_pass} pass every case ({pct(all_pass, n_all)}); "
                  f"silent mismatches: {silent}.**", "",
                  "| family | entries | pass every case | pass rate | silent mismatches | left out by rule |",
                  "|---|---|---|---|---|---|"]
        for r, f in zip(results, figs):
            task = r["meta"].get("task", "causal-lm")
            lines.append(f"| [{tiny.FAMILIES.get(task, task)}](#{anchor(tiny.FAMILIES.get(task, task))}) | "
                         f"{f['entries']} | {f['all_pass']} | {pct(f['all_pass'], f['entries'])} | {f['silent']} | "
                         f"{len(r.get('excluded') or {})} |")
        lines.append("")
    for r in results:
        lines += family_lines(r, heading=len(results) > 1) + [""]
    lines += ["Checkpoint layout: *identical* (the file's names and shapes are the model's), *renamed* "
              "(transformers renames some keys on load), *fused* (transformers builds some tensors from several "
              "of the file's, e.g. per-expert MoE weights stacked into one).", ""]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines))


def anchor(title: str) -> str:
    """GitHub's anchor of a heading."""
    import re

    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")


def task_json(task: str) -> str:
    return os.path.join(HERE, "results", f"{task}.json")


def committed_results() -> List[Dict[str, Any]]:
    """Every task's committed result (scripts/coverage/results/<task>.json), in tiny.TASKS order."""
    out = []
    for task in tiny.TASKS:
        if os.path.exists(task_json(task)):
            with open(task_json(task)) as f:
                out.append(json.load(f))
    return out


def merge(old: Dict[str, Any], new: Dict[str, Any], ids: List[str]) -> Dict[str, Any]:
    """`old` (a task's whole run) with the records and builds of `ids` replaced by `new`'s (a
    rerun of those entries); meta keeps the whole run's figures and gains a note saying which
    entries ran at which commit."""
    if old["meta"]["cases"] != new["meta"]["cases"]:
        raise ValueError(f"cannot merge: the runs' cases differ ({old['meta']['cases']} vs {new['meta']['cases']})")
    rerun = set(ids)
    out = dict(old)
    out["records"] = [r for r in old["records"] if r["id"] not in rerun] + new["records"]
    out["records"].sort(key=lambda r: (r["id"], old["meta"]["cases"].index(r["case"])))
    out["builds"] = sorted([b for b in old["builds"] if b["id"] not in rerun] + new["builds"], key=lambda b: b["id"])
    out["excluded"] = new.get("excluded", old.get("excluded", {}))
    notes = old["meta"].get("note") or []
    notes = [notes] if isinstance(notes, str) else list(notes)
    nm = new["meta"]
    notes.append(f"{len(rerun)} entries ({', '.join(sorted(rerun))}) rerun at commit {nm['commit']} on {nm['date']} "
                 f"({nm['seconds']:.0f} s); the others are the run at {old['meta']['commit']}")
    out["meta"] = dict(old["meta"], note=notes)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("entries", nargs="*", help="model types or variants (TYPE@fp16, TYPE@bin-fp16); "
                    "default: every type of the task and the variants")
    ap.add_argument("--task", default="causal-lm", choices=tiny.TASKS,
                    help="the auto mapping: " + ", ".join(f"{k} ({v})" for k, v in tiny.MAPPINGS.items()))
    ap.add_argument("--no-variants", action="store_true", help="without the fp16 / .bin variants")
    ap.add_argument("--cache", default=DEFAULT_CACHE, help=f"checkpoints, conversions, results (default {DEFAULT_CACHE})")
    ap.add_argument("--json", default=None, help="records (default scripts/coverage/results/<task>.json)")
    ap.add_argument("--doc", default=None, help="the table (default docs/coverage.md for a full run or --merge, "
                    "none otherwise); it holds every task whose results/<task>.json is there")
    ap.add_argument("--merge", action="store_true", help="with entries: replace their records in "
                    "scripts/coverage/results/<task>.json (a note names them and the commit) and regenerate the doc")
    ap.add_argument("--doc-only", action="store_true", help="regenerate the doc from scripts/coverage/results/")
    ap.add_argument("--world-sizes", default="2,3")
    ap.add_argument("--no-fsdp1", action="store_true")
    ap.add_argument("--limit-s", type=float, default=120.0, help="time limit per case (and per build)")
    ap.add_argument("--force", action="store_true", help="rerun every load (checkpoints stay cached)")
    args = ap.parse_args(argv)

    doc = args.doc or os.path.join(REPO, "docs", "coverage.md")
    if args.doc_only:
        write_doc(committed_results(), doc)
        log(f"== {doc}")
        return 0
    if args.merge and (not args.entries or args.json):
        ap.error("--merge takes entries, and writes scripts/coverage/results/<task>.json")
    full = not args.entries
    ids = args.entries or [e["id"] for e in tiny.entries_for(tiny.model_types(args.task), not args.no_variants)]
    result = run(ids, os.path.abspath(args.cache), tuple(int(w) for w in args.world_sizes.split(",")),
                 not args.no_fsdp1, args.limit_s, args.force, args.task)
    shown, skip = [], False  # the options as given, less the machine's cache directory
    for a in (argv if argv is not None else sys.argv[1:]):
        if skip or a == "--cache" or a.startswith("--cache="):
            skip = a == "--cache"
            continue
        shown.append(a)
    command = " ".join(["python scripts/coverage/matrix.py"] + shown)
    result["meta"]["command"] = command
    if args.merge:
        with open(task_json(args.task)) as f:
            result = merge(json.load(f), result, ids)
    json_path = args.json or (task_json(args.task) if full or args.merge else
                              os.path.join(args.cache, f"matrix-{args.task}.json"))
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    if args.doc or ((full or args.merge) and not args.json):
        # Every family whose results are committed, this run's included.
        write_doc(committed_results() if json_path == task_json(args.task) else result, doc)
    else:
        doc = None
    t = totals(result["records"], result["meta"]["cases"])
    log(f"== done in {result['meta']['seconds']:.0f} s: {json_path}" + (f", {doc}" if doc else ""))
    for c, counts in t.items():
        log(f"   {c}: " + ", ".join(f"{s} {n}" for s, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
