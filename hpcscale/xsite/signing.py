"""Per-site ed25519 keys for cross-site records: key files, the keyring, sign and verify.

Key files (docs/cross-site-format.md, "Keys"):
- `<site>.key`: the private key, PKCS#8 PEM, unencrypted, mode 0600. Written whole under a fresh name (created
  O_CREAT|O_EXCL|O_NOFOLLOW with mode 0600) and hard-linked to its name, so an existing key (or a symlink planted
  in its place) is never overwritten and a kill mid-write never leaves part of a key under its name; loading
  refuses a key that group or others may read, as ssh does, and one that is not the user's or root's.
- `<site>.pub`: the public key, SubjectPublicKeyInfo PEM, mode 0644.
- `<site>.<n>.pub` / `<site>.<n>.key`: generation n of a rotated key (n decimal, 1 to 6 digits). A keyring may
  list several generations of one site at once; a record names the key that signed it by `key_id`, and the
  reader accepts it only if that key is listed for the record's site. Rotation is then: publish the new public
  key to every peer, switch signing to it, and remove the old one from the keyrings once its records are
  consumed; no flag day. Because `<site>.<n>.pub` would be ambiguous, a site name may not end in `.<digits>`.

A keyring says who may sign for every site, so it is read only from a directory of the user's or root's that no
one else can write (a sticky one neither: others could add a `<site>.<n>.pub`), and only from `.pub` files of
the user's or root's that no one else can write (hpcscale.util.trust's rule, checked with fstat on the
descriptors read); otherwise UntrustedFile, exit 2, naming the path and the fix.

A key id is the first 16 hex digits of sha256 over the raw 32-byte public key: it picks a key, it proves
nothing (the signature does). Signatures are standard base64 of the 64-byte ed25519 signature (RFC 8032).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import os
import re
import stat
from pathlib import Path
from typing import NamedTuple

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from hpcscale.errors import BadInput, RuntimeFailure
from hpcscale.portable import files
from hpcscale.util import trust
from hpcscale.util.bounded import file_problem

# A site name reaches file names (`<site>.pub`, `contrib-<site>-r000001.json`): one path component, no leading
# dot or dash, bounded. Ending in `.<digits>` is refused because `<site>.<n>.pub` is a key generation.
SITE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_GENERATION_SUFFIX = re.compile(r".*\.[0-9]+")
_PUB_FILE = re.compile(r"(?P<site>.+?)(?:\.(?P<generation>[0-9]{1,6}))?\.pub")

MAX_KEY_FILE_BYTES = 4096  # an ed25519 PEM key is ~120 bytes
MAX_KEYRING_FILES = 10_000  # directory entries looked at; a keyring holds a few keys per site
SIGNATURE_BYTES = 64

# site -> its listed public keys, every generation (oldest first by file name)
Keyring = dict[str, tuple[Ed25519PublicKey, ...]]


class KeyFiles(NamedTuple):
    private: Path
    public: Path


def valid_site_name(name: object) -> bool:
    return isinstance(name, str) and bool(SITE_NAME.fullmatch(name)) and not _GENERATION_SUFFIX.fullmatch(name)


def check_site_name(name: object) -> str:
    if not valid_site_name(name):
        raise BadInput(
            f"site name {name!r}: expected 1-64 of A-Z a-z 0-9 _ . - starting with a letter or digit, "
            "not ending in .<digits>"
        )
    return name  # type: ignore[return-value]


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _stem(site: str, generation: int | None) -> str:
    check_site_name(site)
    if generation is None:
        return site
    if not isinstance(generation, int) or isinstance(generation, bool) or not 0 <= generation <= 999_999:
        raise BadInput(f"key generation {generation!r}: expected an integer from 0 to 999999")
    return f"{site}.{generation}"


def _create_exclusive(path: Path, data: bytes, mode: int) -> None:
    """Create `path` holding `data`, exactly `mode` from its first byte, durably, whole or not at all
    (hpcscale.portable.files.atomic_create: written under a fresh name created O_EXCL|O_NOFOLLOW, then linked to
    `path`): an existing key, or a symlink planted in its place, is never overwritten, and a kill or a full disk
    mid-write never leaves part of a key under its name."""
    try:
        created = files.atomic_create(path, data, mode=mode, exact_mode=True)
    except OSError as e:
        raise RuntimeFailure(f"{path}: cannot create ({e.strerror})") from None
    if not created:
        raise BadInput(f"{path}: already exists; a key is never overwritten (rotate with a new generation)")


def generate_key(directory: str | Path, site: str, *, generation: int | None = None) -> KeyFiles:
    """Create a new ed25519 key pair: `<site>[.<generation>].key` (0600) and `.pub` (0644) in `directory`.
    Refuses (BadInput) when either file exists; nothing is left behind on failure."""
    directory = Path(directory)
    stem = _stem(site, generation)
    private_path, public_path = directory / f"{stem}.key", directory / f"{stem}.pub"
    if os.path.lexists(public_path):  # checked first so that a refusal leaves no private key behind
        raise BadInput(f"{public_path}: already exists; a key is never overwritten (rotate with a new generation)")
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    _create_exclusive(private_path, private_pem, 0o600)
    try:
        _create_exclusive(public_path, public_pem, 0o644)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(private_path)
        raise
    return KeyFiles(private_path, public_path)


def _read_key_file(path: Path, what: str, *, dir_fd: int | None = None) -> tuple[bytes, os.stat_result]:
    """A key file's bytes, from a regular file (never through a symbolic link) of the user's or root's."""

    def owned(st: os.stat_result) -> None:
        if st.st_uid not in trust.trusted_owners():
            raise trust.refuse(path, st, trust.problem(st) or "not yours", what=what)

    try:
        name = path.name if dir_fd is not None else path
        return files.read_regular(name, max_bytes=MAX_KEY_FILE_BYTES, dir_fd=dir_fd, follow_symlinks=False,
                                  check=owned)  # fmt: skip
    except OSError as e:
        raise BadInput(f"{path}: {file_problem(e, what)}") from None


def load_private(path: str | Path) -> Ed25519PrivateKey:
    path = Path(path)
    data, st = _read_key_file(path, "private key")
    if st.st_mode & 0o077:
        raise BadInput(f"{path}: mode {stat.S_IMODE(st.st_mode):04o}; a private key must be readable by its owner only")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise BadInput(f"{path}: not an unencrypted PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise BadInput(f"{path}: not an ed25519 key")
    return key


def load_public(path: str | Path, *, dir_fd: int | None = None) -> Ed25519PublicKey:
    """A public key from a file of the user's or root's that no one else can write (`path` relative to dir_fd,
    a keyring directory already checked, when given)."""
    path = Path(path)
    data, st = _read_key_file(path, "public key", dir_fd=dir_fd)
    why = trust.problem(st)
    if why is not None:  # whoever can write it can put their own key there, and sign as that site
        raise trust.refuse(path, st, why, what="public key")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise BadInput(f"{path}: not a PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise BadInput(f"{path}: not an ed25519 key")
    return key


def load_keyring(directory: str | Path) -> Keyring:
    """Every `<site>.pub` and `<site>.<n>.pub` in `directory` (not below it). Other names, and names whose site
    part is not a valid site name, are skipped; a matching file that is not a readable ed25519 public key is
    BadInput (a keyring an administrator must fix, not one to half-use)."""
    directory = Path(directory)
    found: dict[str, list[tuple[str, Ed25519PublicKey]]] = {}
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # a linked keyring: where it leads
    except FileNotFoundError:
        raise BadInput(f"{directory}: no such keyring directory") from None
    except NotADirectoryError:
        raise BadInput(f"{directory}: not a directory") from None
    except OSError as e:
        raise BadInput(f"{directory}: cannot read the keyring ({e.strerror})") from None
    try:
        trust.check_dir_fd(fd, directory, what="keyring directory")  # whoever can add a file can sign as anyone
        with os.scandir(fd) as entries:
            for count, entry in enumerate(entries):
                if count >= MAX_KEYRING_FILES:
                    raise BadInput(f"{directory}: more than {MAX_KEYRING_FILES} entries; not a keyring")
                m = _PUB_FILE.fullmatch(entry.name)
                if not m or not valid_site_name(m["site"]):
                    continue
                key = load_public(directory / entry.name, dir_fd=fd)
                found.setdefault(m["site"], []).append((entry.name, key))
    except PermissionError as e:
        raise BadInput(f"{directory}: cannot read the keyring ({e.strerror})") from None
    finally:
        os.close(fd)
    return {site: tuple(k for _, k in sorted(keys, key=lambda nk: nk[0])) for site, keys in sorted(found.items())}


def sign(private: Ed25519PrivateKey, data: bytes) -> str:
    return base64.b64encode(private.sign(data)).decode("ascii")


def verify(public: Ed25519PublicKey, data: bytes, signature: object) -> bool:
    """True when `signature` (base64 text) is `public`'s signature of `data`; False for anything else,
    malformed input included. Never raises."""
    if not isinstance(signature, str) or len(signature) > 2 * SIGNATURE_BYTES:
        return False
    try:
        raw = base64.b64decode(signature.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        return False
    # Only the canonical encoding: base64 has spare bits in its last digit, and a record whose bytes could
    # change without its signature failing would be malleable.
    if len(raw) != SIGNATURE_BYTES or base64.b64encode(raw).decode("ascii") != signature:
        return False
    try:
        public.verify(raw, data)
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True
