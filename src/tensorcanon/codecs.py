"""``tensorcanon.codecs``, the documented import path of :mod:`tensorcanon.format.codecs`."""

from .format.codecs import (
    NAMES,
    register_all,
    register_bytes_io,
    register_datetime,
    register_namespace,
    register_paths,
)

__all__ = ["register_paths", "register_datetime", "register_namespace", "register_bytes_io", "register_all",
           "NAMES"]
