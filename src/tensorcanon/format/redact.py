"""What a message may show of a URL: the one redaction every message of the library goes through.

:func:`redact` hides, anywhere in a text (a URL, a whole error message, a store's own
exception text), the two places credentials sit in URLs:

- the password of a ``scheme://user:password@host`` (``user:***@``), and a userinfo
  without a password (a token used as the user name: ``***@``). It works on the text,
  not on a parsed URL, so a URL that :func:`urllib.parse.urlsplit` cannot parse (a
  password holding ``/``, ``[`` or ``#``; a bad IPv6 host) is hidden all the same;
- the values of query parameters that carry credentials (presigned URLs, SAS tokens):
  ``X-Amz-Signature``, ``X-Amz-Credential``, ``X-Amz-Security-Token``, ``Signature``,
  ``X-Goog-Signature``, ``sig``, ``token``, ``access_token``, ``key``, ``password``... (the
  name is matched case-insensitively, percent-encoded or not), after ``?``, ``&``, ``;``,
  ``#``, a space, a comma, a parenthesis or a quote, as they appear in URLs and in the
  ``Authorization`` headers some clients quote in their errors.

Every :class:`~tensorcanon.TensorCanonError` passes its message through it when it is
made (format/errors.py), so no message of the library shows a credential, whichever
code built it. It only hides: text without credentials comes back unchanged.
"""

from __future__ import annotations

import re
import urllib.parse

__all__ = ["redact", "has_secret"]

HIDDEN = "***"

# A URL in a message: a run of characters up to whitespace or a quote; its scheme. Each run is
# looked at once (linear in the text, whatever it holds: messages quote a file's keys).
_TOKEN = re.compile(r"[^\s'\"<>]+")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")

# name=value after a delimiter; the name may be percent-encoded (X%2DAmz%2DSignature).
_PARAM = re.compile(r"(?P<lead>^|[?&;#\s,('\"])(?P<name>[A-Za-z0-9_.%\-]+)=(?P<value>[^&\s'\"<>#;,)\]]*)")
_SECRET_NAME = re.compile(
    r"signature|token|secret|credential|password|passw|apikey|api-key|api_key|accesskey|access_key"
    r"|(?:^|[-_.])(?:sig|key|pwd|auth|sas)$", re.IGNORECASE)


def _userinfo(m: re.Match[str]) -> str:
    """One run of a message: the userinfo after its first ``scheme://`` hidden, up to the run's
    last ``@`` (so that a password holding an ``@`` is hidden whole; when the URL's path holds an
    ``@`` too, more than the password is hidden, never less)."""
    token = m.group(0)
    at = token.rfind("@")
    scheme = _SCHEME.search(token, 0, at) if at > 0 else None
    if scheme is None:
        return token
    info = token[scheme.end():at]
    user, colon, _ = info.partition(":")
    if colon:
        if "/" in user or "[" in user:  # an "@" in a path, after a host[:port] ("https://[::1]:80/a@b")
            return token
        return f"{token[:scheme.end()]}{user}:{HIDDEN}{token[at:]}"
    if "/" in info or not info:  # an "@" in the path (s3://bucket/user@example.com/x), no password before it
        return token
    return f"{token[:scheme.end()]}{HIDDEN}{token[at:]}"


def _param(m: re.Match[str]) -> str:
    name = m.group("name")
    if not m.group("value") or not _SECRET_NAME.search(urllib.parse.unquote(name)):
        return m.group(0)
    return f"{m.group('lead')}{name}={HIDDEN}"


def redact(text: str) -> str:
    """``text`` with every URL password and credential query parameter in it hidden (see the
    module docstring); any other text is returned unchanged."""
    if not isinstance(text, str):
        return text
    if "@" in text and "://" in text:
        text = _TOKEN.sub(_userinfo, text)
    if "=" in text:
        text = _PARAM.sub(_param, text)
    return text


def has_secret(text: str) -> bool:
    """True when :func:`redact` would hide something in ``text``."""
    return redact(text) != text
