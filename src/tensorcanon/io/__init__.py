"""Files: sources (paths, file objects, bytes, memory maps, object storage), the reader and the
writer, atomic replacement, preallocation, CUDA staging, device placement, lazy access.

Above :mod:`tensorcanon.format`, below everything else (docs/ARCHITECTURE.md).
"""
