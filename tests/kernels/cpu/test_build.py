"""Building the CPU C kernels (`baton_cpu/build.py`): a kernel is rebuilt when its source or a
local header it includes changes, and a missing source leaves the torch path (None)."""

from __future__ import annotations

import shutil

import pytest

from baton_cpu import build

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler")


def _write(tmp_path, value: int):
    (tmp_path / "inc").mkdir(exist_ok=True)
    (tmp_path / "inc" / "value.h").write_text(f"#define VALUE {value}\n")
    src = tmp_path / "answer.c"
    src.write_text('#include "inc/value.h"\nint answer(void) { return VALUE; }\n')
    return src


def test_header_change_rebuilds(tmp_path):
    cache = tmp_path / "cache"
    src = _write(tmp_path, 41)
    assert build._build_and_load(src, cache).answer() == 41
    _write(tmp_path, 42)  # the source is unchanged, the header is not
    assert build._build_and_load(src, cache).answer() == 42
    assert len(list((cache / "kernels").glob("answer-*.so"))) == 2


def test_missing_source_gives_none(tmp_path):
    assert build.load_library(tmp_path / "absent.c", tmp_path) is None
