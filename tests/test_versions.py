"""The package version and the format versions are kept apart, and CHANGELOG.md numbers releases
as its head says (SemVer for the package; the format's integer version separately)."""

from __future__ import annotations

import os
import re

from packaging.version import Version

import tensorcanon
from tensorcanon.format import manifest, sharding
from tensorcanon.tools import lockfile, versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELEASE = re.compile(r"## (\d+\.\d+\.\d+) \((\d{4}-\d\d-\d\d), up to ([0-9a-f]{7,40})\): writes file format (\d+)")


def _changelog() -> str:
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as fh:
        return fh.read()


def test_describe_states_the_package_and_every_format_version_apart():
    package, formats = versions.describe().split("\n")
    assert package == f"tensorcanon {tensorcanon.__version__}"
    assert f"writes file format {manifest.VERSION} (reads 1, 2, 3)" in formats
    assert tensorcanon.FORMAT_VERSION == manifest.VERSION
    assert f"sharded layout {sharding.LAYOUT_VERSION}" in formats
    assert f"lockfile {lockfile.VERSION} (reads 1, 2, 3)" in formats
    assert tensorcanon.__version__ not in formats


def test_a_file_written_now_records_the_format_version_describe_states():
    import base64
    import json
    import struct

    import msgpack

    data = tensorcanon.dumps({"x": 1})
    (n,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8:8 + n])["__metadata__"]
    packed = msgpack.unpackb(base64.b64decode(meta["tensorcanon.manifest"]), strict_map_key=False)
    assert packed["version"] == manifest.VERSION
    assert f"writes file format {packed['version']} " in versions.describe()


def test_changelog_has_unreleased_on_top_then_releases_newest_first():
    text = _changelog()
    level2 = re.findall(r"^## .*$", text, flags=re.M)
    assert level2[0] == "## Unreleased", "the first section must be '## Unreleased' (others add entries there)"
    releases = [RELEASE.match(h) for h in level2[1:]]
    assert all(releases), [h for h, m in zip(level2[1:], releases, strict=True) if not m]
    numbers = [Version(m.group(1)) for m in releases if m]
    assert numbers == sorted(numbers, reverse=True) and len(set(numbers)) == len(numbers), numbers
    dates = [m.group(2) for m in releases if m]
    assert dates == sorted(dates, reverse=True), dates


def test_the_package_version_is_the_next_release_in_development():
    latest = Version(RELEASE.search(_changelog()).group(1))
    ours = Version(tensorcanon.__version__)
    assert ours.is_devrelease and Version(ours.base_version) > latest, (
        f"__version__ {ours} must be a .dev release of the version after {latest}, the latest in CHANGELOG.md "
        "(at a release: set it to that version and add its section)")


def test_docs_name_releases_not_version_zero_point_something():
    """'version 0.1' reads like a format version; releases are named by their number ('since 0.2.0')."""
    pages = ["README.md"] + [f"docs/{n}" for n in sorted(os.listdir(os.path.join(ROOT, "docs"))) if n.endswith(".md")]
    for page in pages:
        with open(os.path.join(ROOT, page), encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                assert not re.search(r"\b[Vv]ersion 0\.\d", line), \
                    f"{page}:{n}: name the release ('since 0.2.0'): {line}"
