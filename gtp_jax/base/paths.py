"""Paths given as URLs: ``file://`` ones name local paths, and checkpoint directories may also
be the object stores orbax writes to. Any other URL is refused where it is given: a flag that
writes local files would otherwise create a folder named ``file:`` or ``http:`` under the
working folder, and orbax fails on an unknown scheme with an internal ``KeyError``."""

from __future__ import annotations

from urllib.parse import urlsplit

from gtp_jax.base.errors import UsageError

#: URL schemes checkpoint directories accept (orbax writes through etils' ``epath``).
STORAGE_SCHEMES = ("gs", "s3", "az")


def local_path(text: str, *, storage: bool = False,
               error: type[Exception] = UsageError) -> str:
    """`text` with a ``file://`` URL replaced by the path it names; other URLs are kept when
    `storage` allows their scheme (`STORAGE_SCHEMES`), else refused.

    Raises:
      `error` (default UsageError): a URL of another scheme, or a ``file://`` URL naming a
        remote host.
    """
    if "://" not in text:
        return text
    url = urlsplit(text)
    if url.scheme == "file":
        if url.netloc not in ("", "localhost") or not url.path:
            raise error(f"{text!r}: a file:// URL names a local path (file:///abs/path); "
                        "or pass the path itself.")
        return url.path
    if storage and url.scheme in STORAGE_SCHEMES:
        return text
    where = (", or an object store: " + ", ".join(f"{s}://" for s in STORAGE_SCHEMES)
             if storage else "")
    raise error(f"{text!r}: {url.scheme}:// is not supported here; pass a local path (or "
                f"file:///abs/path){where}")
