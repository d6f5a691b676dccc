"""``tensorcanon store ls|verify|export|gc|stats ROOT …``: a checkpoint store from the command line
(docs/STORE.md, docs/CLI.md). Exit status as ``verify``, for every action: 0 every check passed, 1
something the action read is damaged (a record, a pack, a blob: named), 2 an error (a usage mistake,
no such tag, a store that cannot be reached or is not one)."""

from __future__ import annotations

import argparse
from typing import Any

from ..format.errors import FormatError, IntegrityError, MissingFileError

EXIT_OK, EXIT_DAMAGED, EXIT_ERROR = 0, 1, 2


def add_parser(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``store`` subcommand's parser, with its own subcommands."""
    p = sub.add_parser("store", parents=[common], help="list, verify, export and clean a checkpoint store",
                       description="A store of many checkpoints (tensorcanon.Store: docs/STORE.md). ROOT is its "
                                   "folder or URL (credentials from the environment, as for every command).")
    actions = p.add_subparsers(dest="action", metavar="ACTION", help="what to do with the store")
    actions.required = True
    a = actions.add_parser("ls", parents=[common], help="the tags, with their digests and sizes")
    a.add_argument("root", metavar="ROOT")
    a = actions.add_parser("verify", parents=[common], help="check tags (default: the whole store, every blob)")
    a.add_argument("root", metavar="ROOT")
    a.add_argument("tags", nargs="*", metavar="TAG", help="only these tags (default: every tag and every blob)")
    a = actions.add_parser("export", parents=[common], help="write a tag as the file tensorcanon.save writes (a "
                           "sharded checkpoint's tag: the directory tensorcanon.dcp.save writes)")
    a.add_argument("root", metavar="ROOT")
    a.add_argument("tag", metavar="TAG")
    a.add_argument("output", metavar="OUT", help="the file (or URL) to write, atomically; a sharded checkpoint's "
                   "directory (local, new or empty)")
    a = actions.add_parser("gc", parents=[common], help="delete the blobs no tag needs")
    a.add_argument("root", metavar="ROOT")
    a = actions.add_parser("stats", parents=[common], help="logical and stored bytes, blobs per codec")
    a.add_argument("root", metavar="ROOT")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace, out: Any) -> int:
    from ..io import storage
    from ..store import Store

    store = Store(args.root)
    root = storage.redact(args.root)
    store._check_root()  # (every action reads a store that exists: else an error, exit 2)
    if args.action == "verify":
        return _verify(store, root, args.tags, out)
    try:
        return _act(store, root, args, out)
    except (FormatError, IntegrityError) as e:  # (a record, pack or blob the action met is damaged)
        out.error(f"{e} ('tensorcanon store verify {root}' lists every damaged tag, pack and blob)")
        return EXIT_DAMAGED


def _act(store: Any, root: str, args: argparse.Namespace, out: Any) -> int:
    """``ls``, ``export``, ``gc`` or ``stats``; the store's damage raised."""
    from ..io import storage
    from ..store import layout, sharded
    from .progress import short_size

    if args.action == "ls":
        rows = []
        tags = store.tags()
        for tag in list(tags):  # (a sharded checkpoint: the logical digest its save returned, its directory's bytes)
            try:
                s = sharded.summary(store, tag)
            except MissingFileError:
                if not store._vanished(layout.tag_path(tag), layout.TAGS):
                    raise
                tags.remove(tag)  # (deleted by another writer since it was listed: not a tag any more)
                continue
            rows.append({"tag": tag, "digest": s.digest, "logical_bytes": s.size,
                         "kind": "file" if s.ranks is None else "sharded", "ranks": s.ranks})
        width = max((len(tag) for tag in tags), default=3)
        for r in rows:  # (80 columns for tags of up to 16 characters: the exact bytes are in --json)
            kind = "" if r["ranks"] is None else f"  {r['ranks']} rank{'s' * (r['ranks'] != 1)}"
            out.line(f"{r['tag']:<{width}}  {r['digest']}  {short_size(r['logical_bytes']):>9}{kind}")
        out.json({"root": root, "tags": rows})
        return EXIT_OK
    if args.action == "export":
        if _sharded(store, args.tag):  # (the directory tensorcanon.dcp.save writes, byte for byte)
            digest = sharded.export(sharded.Tag(store, args.tag), args.output)
        else:
            digest = store.export(args.tag, args.output)
        out.line(f"{args.tag} -> {storage.redact(args.output)}  {digest}")
        out.json({"tag": args.tag, "output": storage.redact(args.output), "digest": digest})
        return EXIT_OK
    if args.action == "gc":
        found = store.gc()
        # (a pack whose index cannot be read is kept, unread: what it holds is unknown; that is damage;
        # so is a pack gc was to rewrite that does not hash to its name or holds a copy that does not check)
        unread = [(store._b.display(rel), f"kept pack {store._b.display(rel)!r}, which cannot be read (what it "
                   f"holds is unknown): {e}", str(e)) for rel, e in sorted(store._bad_packs.items())]
        damaged = [(store._b.display(rel), f"kept pack {store._b.display(rel)!r}, which is damaged: {e}", str(e))
                   for rel, e in sorted(store._gc_damaged.items()) if rel not in store._bad_packs]
        bad = unread + damaged
        out.line(f"deleted {found['deleted_blobs']} blobs ({found['freed_bytes']:,} bytes freed), kept "
                 f"{found['kept_blobs']}; packs deleted {found['deleted_packs']}, written {found['written_packs']}")
        for _, warning, _ in bad:
            out.warn(f"{warning} ('tensorcanon store verify {root}' lists every damaged tag, pack and blob)")
        out.json({"root": root, **found, "damaged_packs": [{"pack": w, "error": e} for w, _, e in bad]})
        return EXIT_DAMAGED if bad else EXIT_OK
    stats = store.stats()
    ratio = stats["stored_bytes"] / stats["logical_bytes"] if stats["logical_bytes"] else 0.0
    out.line(f"tags           {stats['tags']}")
    codecs = ", ".join(f"{k} {v}" for k, v in stats["codecs"].items()) or "none"
    out.line(f"blobs          {stats['blobs']}  ({codecs})")
    out.line(f"packs          {stats['packs']}  ({stats['pack_bytes']:,} bytes; "
             f"{stats['blobs'] - stats['loose_blobs']} blobs packed, {stats['loose_blobs']} loose)")
    out.line(f"logical bytes  {stats['logical_bytes']:,}")
    out.line(f"stored bytes   {stats['stored_bytes']:,}  ({ratio:.3f} of logical)")
    out.json({"root": root, **stats})
    return EXIT_OK


def _verify(store: Any, root: str, tags: list[str], out: Any) -> int:
    code, results = EXIT_OK, []
    from ..store import layout, sharded

    if tags:
        checks = []
        for tag in tags:
            try:
                checks.append(("tag", tag, store.verify(tag)))
            except (FormatError, IntegrityError) as e:
                checks.append(("tag", tag, e))
    else:
        checks = list(store.checks())
    gone = set()
    for i, (kind, name, result) in enumerate(checks):
        if kind == "tag" and not isinstance(result, BaseException):
            try:  # (its record and blobs are sound: now the checkpoint, and the digest its save returned)
                if sharded.claims(store, name):
                    checks[i] = (kind, name, sharded.verify(store, name))
            except (FormatError, IntegrityError, MissingFileError) as e:
                if not tags and store._vanished(layout.tag_path(name), layout.TAGS):
                    gone.add(i)  # (the whole store's check: deleted by another writer since it was listed, as checks())
                    continue
                if isinstance(e, MissingFileError):
                    raise
                checks[i] = (kind, name, e)
    checks = [c for i, c in enumerate(checks) if i not in gone]
    for kind, name, result in checks:
        if isinstance(result, BaseException):
            code = EXIT_DAMAGED
            results.append({kind: name, "status": "damaged", "error": str(result)})
            text = str(result)  # (the error names its tag or pack first: the line names it once)
            out.line(f"DAMAGED  {kind} {name}: {text.removeprefix(f'{kind} {name!r}: ')}")
        elif kind == "tag":
            results.append({"tag": name, "status": "ok", "digest": result})
            out.line(f"OK       tag {name}  {result}")
        else:
            results.append({kind: name, "status": "ok"})
    if not tags:
        n_tags, blobs, packs = (sum(1 for k, _, _ in checks if k == what) for what in ("tag", "blob", "pack"))
        out.line(f"{'DAMAGED' if code else 'OK'}: {root}: {n_tags} tag{'s' * (n_tags != 1)} checked, "
                 f"{blobs} loose blob{'s' * (blobs != 1)} that no tag uses, and {packs} pack{'s' * (packs != 1)}")
    out.json({"root": root, "results": results})
    return code


def _sharded(store: Any, tag: str) -> bool:
    """Whether ``tag``'s record is a sharded checkpoint's (False for a tag another writer deleted
    since it was checked: the action then meets its absence as any tag's)."""
    from ..store import sharded

    try:
        return sharded.claims(store, tag)
    except MissingFileError:
        return False
