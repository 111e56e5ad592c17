"""Time each chapter as a learner runs it: cell by cell, as a notebook would, in one process.

    python lab/time_chapters.py tutorials/03-layer-norm.py [...] --out times.jsonl

A chapter's cells are the ``# %%`` blocks that sphinx-gallery makes notebook cells from.
Each chapter runs in its own subprocess (a fresh interpreter, as a fresh kernel would be);
that process executes the cells in one namespace and prints each cell's wall time, the
chapter's total (import of torch included) and the first line of the cell, so the slow
cells can be found. With several GPUs, ``--gpus 4`` runs four chapters at once, one per GPU
(CUDA_VISIBLE_DEVICES), so each chapter still has a GPU to itself. ``--jobs N`` runs N at once
over the GPUs in turn (``--gpus 1 --jobs 4``: four chapters sharing one GPU): each chapter's
time is then an upper bound on its time alone, as they share the GPU and the CPU's cores.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import queue
import subprocess
import sys
import threading
import time
import types


def cells(path: Path) -> list[tuple[int, str]]:
    """The chapter's code blocks as (first line number, source); text cells hold only
    comments, which run as nothing."""
    blocks, start, lines = [], 1, []
    for number, line in enumerate(path.read_text().splitlines(keepends=True), 1):
        if line.startswith("# %%"):
            if lines:
                blocks.append((start, "".join(lines)))
            start, lines = number + 1, []
        else:
            lines.append(line)
    if lines:
        blocks.append((start, "".join(lines)))
    return blocks


def run_cells(path: Path) -> None:
    """Run in the child: every cell, timed; one JSON line per cell on stdout."""
    begin = time.perf_counter()
    # the cells run in a module named __main__, as a script's or a notebook's do
    # (torch.compile's guards look names up in it)
    module = types.ModuleType("__main__")
    module.__file__ = str(path)
    sys.modules["__main__"] = module
    namespace = module.__dict__
    sys.argv = [str(path)]
    for line, source in cells(path):
        # padded so that line numbers are the file's: Triton reads a kernel's source
        # through them
        code = compile("\n" * (line - 1) + source, str(path.resolve()), "exec")
        started = time.perf_counter()
        exec(code, namespace)
        took = time.perf_counter() - started
        first = next((s for s in source.splitlines() if s and not s.startswith("#")), "")
        print(json.dumps({"line": line, "s": round(took, 2), "code": first[:70]}), flush=True)
    total = time.perf_counter() - begin
    print(json.dumps({"chapter": path.name, "total_s": round(total, 1)}), flush=True)


def run_chapter(path: str, gpu: str | None, timeout: float) -> dict:
    env = dict(os.environ, MPLBACKEND="agg")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--child", path],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
        out, err, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as stopped:
        out = (stopped.stdout or b"").decode() if isinstance(stopped.stdout, bytes) else (stopped.stdout or "")
        err, code = "timed out", "timeout"
    wall = time.perf_counter() - started
    cell_times = [json.loads(s) for s in out.splitlines() if s.startswith('{"line"')]
    return {
        "chapter": Path(path).name,
        "wall_s": round(wall, 1),
        "exit": code,
        "cells": cell_times,
        "error": err[-1500:] if code != 0 else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chapters", nargs="+")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=None, help="chapters at once (default: --gpus)")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.child:
        run_cells(Path(args.chapters[0]))
        return
    todo: queue.Queue = queue.Queue()
    for chapter in args.chapters:
        todo.put(chapter)
    results, lock = [], threading.Lock()

    def worker(gpu: str | None) -> None:
        while True:
            try:
                chapter = todo.get_nowait()
            except queue.Empty:
                return
            result = run_chapter(chapter, gpu, args.timeout)
            with lock:
                results.append(result)
                slow = sorted(result["cells"], key=lambda c: -c["s"])[:3]
                print(
                    f"{result['chapter']}: {result['wall_s']} s (exit {result['exit']}); "
                    + "; ".join(f"line {c['line']} {c['s']} s {c['code']!r}" for c in slow),
                    flush=True,
                )
                if result["error"]:
                    print("   ", result["error"][-600:].replace("\n", "\n    "), flush=True)

    jobs = args.jobs or args.gpus
    gpus = [str(i % args.gpus) if args.gpus > 1 else None for i in range(jobs)]
    threads = [threading.Thread(target=worker, args=(g,)) for g in gpus]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if args.out:
        with open(args.out, "w") as f:
            for result in sorted(results, key=lambda r: r["chapter"]):
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
