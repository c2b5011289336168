"""An offline English text corpus from what any Python machine has, as JSONL for tools/preprocess_data.py.

    python tools/text_corpus.py --out data/text.jsonl --max-mb 32
    python tools/preprocess_data.py --input data/text.jsonl --output-prefix data/text

No download: the GPU machine of tools/gpu/gmin_sweep.sh is offline and holds Python, torch, triton and their
site-packages. Sources, in this order, until ``--max-mb`` MB of text:

1. ``docs``: documentation files (``*.md``, ``*.rst``, ``*.txt``, ``*.html`` stripped of tags) and the package
   descriptions in ``*.dist-info/METADATA`` under the Python installation (the standard library and the
   site-packages directories);
2. ``docstrings``: the module, class and function docstrings of the ``.py`` files in site-packages (English
   prose about code: torch alone has tens of MB), one document per module;
3. ``usr-share-doc``: ``/usr/share/doc`` (READMEs, changelogs; ``.gz`` files decompressed), last because
   package changelogs are repetitive.

Files are read in sorted path order, binary and tiny ones (< ``--min-chars``) skipped, exact duplicates dropped
(licence texts repeat), then the documents are shuffled with a fixed seed so that Megatron's contiguous document
split (train, valid, test) draws every split from every source. The same machine gives the same file, byte for
byte. A manifest (``OUT.manifest.json``) records the documents and megabytes per source and the roots read.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import os
import random
import re
import site
import sys
import sysconfig
import warnings

DOC_EXTS = (".md", ".rst", ".txt", ".html")
TAG = re.compile(r"<[^>]+>")
MAX_FILE_BYTES = 4 << 20


def python_roots() -> list[str]:
    """The site-packages directories and the standard library (not all of sys.prefix, which may be /usr)."""
    paths = sysconfig.get_paths()
    roots = {paths["purelib"], paths["platlib"], paths["stdlib"]}
    try:
        roots.update(site.getsitepackages())
    except AttributeError:
        pass
    roots.update(p for p in sys.path if p.endswith("site-packages"))
    real = sorted({os.path.realpath(r) for r in roots if os.path.isdir(r)})
    # drop roots inside other roots (site-packages under sys.prefix): each file once
    return [r for r in real if not any(r != o and r.startswith(o + os.sep) for o in real)]


def _walk(root: str):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        dirnames[:] = [d for d in dirnames if d not in ("__pycache__", ".git")]
        for name in sorted(filenames):
            yield os.path.join(dirpath, name)


def _read_text(path: str) -> str | None:
    try:
        if os.path.getsize(path) > MAX_FILE_BYTES:
            return None
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = f.read(MAX_FILE_BYTES)
        else:
            with open(path, "rb") as f:
                data = f.read()
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    if b"\x00" in data:
        return None
    text = data.decode("utf-8", errors="replace")
    if text.count("\ufffd") > len(text) // 100:
        return None
    return text


def doc_files(roots: list[str]):
    for root in roots:
        for path in _walk(root):
            name = os.path.basename(path)
            if name == "METADATA" and path.endswith(".dist-info" + os.sep + "METADATA") or name.endswith(DOC_EXTS):
                if name.endswith(("entry_points.txt", "top_level.txt", "RECORD", "SOURCES.txt")):
                    continue
                text = _read_text(path)
                if text is not None:
                    yield path, TAG.sub(" ", text) if name.endswith(".html") else text


def usr_share_doc(root: str = "/usr/share/doc"):
    if not os.path.isdir(root):
        return
    for path in _walk(root):
        if os.path.islink(path):
            continue
        text = _read_text(path)
        if text is not None:
            yield path, text


def docstrings(roots: list[str]):
    for root in roots:
        for path in _walk(root):
            if not path.endswith(".py") or "site-packages" not in path:
                continue
            source = _read_text(path)
            if source is None:
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # invalid escape sequences in old packages
                    tree = ast.parse(source)
            except (SyntaxError, ValueError):
                continue
            parts = []
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc:
                        parts.append(doc)
            if parts:
                yield path, "\n\n".join(parts)


def build(out: str, max_mb: float, min_chars: int = 200, seed: int = 0, include_docstrings: bool = True,
          log=print) -> dict:
    roots = python_roots()
    budget = int(max_mb * 1e6)
    seen, docs = set(), []
    manifest = dict(roots=roots + ["/usr/share/doc"], max_mb=max_mb, sources={}, seed=seed)
    total = 0
    sources = [("docs", doc_files(roots))]
    if include_docstrings:
        sources.append(("docstrings", docstrings(roots)))
    sources.append(("usr-share-doc", usr_share_doc()))
    for kind, items in sources:
        count = size = 0
        for path, text in items:
            text = text.strip()
            if len(text) < min_chars:
                continue
            digest = hashlib.sha1(text.encode("utf-8", errors="replace")).digest()
            if digest in seen:
                continue
            seen.add(digest)
            nbytes = len(text.encode("utf-8", errors="replace"))
            docs.append(dict(text=text, source=kind, path=path))
            count, size, total = count + 1, size + nbytes, total + nbytes
            if total >= budget:
                break
        manifest["sources"][kind] = dict(documents=count, mb=round(size / 1e6, 2))
        log(f"  {kind}: {count} documents, {size / 1e6:.1f} MB")
        if total >= budget:
            break
    random.Random(seed).shuffle(docs)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    manifest.update(documents=len(docs), mb=round(total / 1e6, 2))
    with open(out + ".manifest.json", "w") as f:
        json.dump(manifest, f, indent=1)
    log(f"wrote {out}: {len(docs)} documents, {total / 1e6:.1f} MB ({out}.manifest.json)")
    return manifest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSONL output, one {'text', 'source', 'path'} per line")
    p.add_argument("--max-mb", type=float, default=32.0, help="stop after this many MB of text (default 32)")
    p.add_argument("--min-chars", type=int, default=200, help="skip shorter texts (default 200)")
    p.add_argument("--seed", type=int, default=0, help="document shuffle seed (default 0)")
    p.add_argument("--no-docstrings", action="store_true", help="documentation files only")
    args = p.parse_args(argv)
    if args.max_mb <= 0:
        print(f"error: --max-mb={args.max_mb}: must be > 0", file=sys.stderr)
        return 2
    build(args.out, args.max_mb, args.min_chars, args.seed, not args.no_docstrings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
