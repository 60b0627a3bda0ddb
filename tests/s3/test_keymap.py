"""The key <-> path mapping: reversible, valid POSIX names, order-preserving bounds (pure code)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from threefs.s3 import keymap

SEGMENT = st.one_of(st.sampled_from(["", ".", "..", "%", "%e", "%o", "%cx", "a", "a.b"]),
                    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00"),
                            max_size=300))


def decode_path(comps: list[str], name: str) -> str:
    """What listing does: directories contribute `segment/` (or a piece), the file its segment."""
    key = ""
    for c in comps:
        key, _ = keymap.entry_key(key, c, True)
    key, exact = keymap.entry_key(key, name, False)
    assert exact
    return key


@settings(max_examples=400, deadline=None)
@given(st.lists(SEGMENT, min_size=1, max_size=5))
def test_mapping_is_reversible_and_names_are_valid(segments):
    key = "/".join(segments)
    if not key or len(key.encode()) > keymap.KEY_BYTES_MAX:
        return
    comps, name = keymap.key_components(key)
    for c in comps + [name, keymap.ALT_PREFIX + name]:
        assert c not in ("", ".", "..") and "/" not in c and "\x00" not in c
        assert len(c.encode()) <= 255
    assert decode_path(comps, name) == key
    assert decode_path(comps, keymap.ALT_PREFIX + name) == key  # the %o form decodes to the same key


@settings(max_examples=200, deadline=None)
@given(st.lists(SEGMENT, min_size=1, max_size=4))
def test_directory_bounds_are_prefixes_of_their_keys(segments):
    """Listing relies on it: every key below a directory starts with the directory's bound."""
    key = "/".join(segments)
    if not key or len(key.encode()) > keymap.KEY_BYTES_MAX:
        return
    comps, _ = keymap.key_components(key)
    bound = ""
    for c in comps:
        bound, _ = keymap.entry_key(bound, c, True)
        assert key.startswith(bound)


def test_examples():
    assert keymap.key_components("photos/2024/a.jpg") == (["photos", "2024"], "a.jpg")
    assert keymap.key_components("a/") == (["a"], "%e")
    assert keymap.key_components("./../%x") == (["%d", "%dd"], "%%x")
    comps, name = keymap.key_components("é" * 150)  # 300 bytes: one continuation directory
    assert comps == ["%c" + "é" * 100] and name == "é" * 50
