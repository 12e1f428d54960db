"""Shared buffers and the tables an HCA publishes for direct placement (`ckpt.verbs._shm`)."""

from __future__ import annotations

import gc
import io
import os
import pickle

import numpy as np
import pytest

from ckpt import verbs as v
from ckpt.runtime import _pickling
from ckpt.verbs import _hca, _shm

pytestmark = pytest.mark.timeout(30)


def test_a_shared_array_is_zeroed_memory_in_a_memfd_that_locate_finds() -> None:
    a = v.shared_array((4, 8), np.int64)
    assert isinstance(a, np.ndarray) and a.shape == (4, 8) and not a.any()
    addr = int(a.ctypes.data)
    seg, offset = _shm.locate(addr + 16, 8)  # type: ignore[misc]
    assert offset == 16 and os.fstat(seg.fd).st_ino == seg.ino and seg.addr == addr
    assert os.readlink(f"/proc/self/fd/{seg.fd}") == f"/memfd:{_shm.SEGMENT_NAME} (deleted)"
    del seg
    assert _shm.locate(addr + a.nbytes - 4, 8) is None  # runs past its end
    assert _shm.locate(int(np.zeros(8).ctypes.data), 8) is None  # private memory


def test_a_segment_is_given_back_when_its_last_array_goes() -> None:
    a = v.shared_array(4096)
    view = a[100:200]
    addr = int(a.ctypes.data)
    fd = _shm.locate(addr, 1)[0].fd  # type: ignore[index]
    del a
    gc.collect()
    assert _shm.locate(addr, 1) is not None  # the view keeps it
    del view
    gc.collect()
    assert _shm.locate(addr, 1) is None
    with pytest.raises(OSError):
        os.fstat(fd)


@pytest.mark.parametrize("dumps", ["pickle", "image"])
def test_a_shared_array_unpickles_into_shared_memory_again(dumps: str) -> None:
    a = v.shared_array(1 << 17, np.uint8)
    a[:5] = [1, 2, 3, 4, 5]
    if dumps == "pickle":
        b = pickle.loads(pickle.dumps(a, protocol=5))
    else:  # the image pickler: big buffers out of band
        stream, sections = _pickling.pickle_with_buffers(a)
        b = _pickling.ImageUnpickler(io.BytesIO(bytes(stream)), [bytes(view) for _, view in sections], []).load()
    assert isinstance(b, v.SharedArray) and b[:5].tolist() == [1, 2, 3, 4, 5]
    assert _shm.locate(int(b.ctypes.data), b.nbytes) is not None
    assert int(b.ctypes.data) != int(a.ctypes.data)


def test_copies_results_and_views_pickle_as_private_memory() -> None:
    a = v.shared_array(16, np.int64)
    for b in (a + 1, a.copy()):  # a ufunc's result, a copy: private memory, of the subclass
        assert b._segment is None  # type: ignore[attr-defined]
        assert type(pickle.loads(pickle.dumps(b))) is np.ndarray
    view = a[2:5]
    assert view.base is a and a._segment is not None  # type: ignore[attr-defined]
    assert type(pickle.loads(pickle.dumps(view))) is np.ndarray  # a view pickles as a copy, as numpy's do


def test_a_region_keeps_its_segment_while_registered() -> None:
    with v.Context(name="simib0") as ctx:
        pd = v.PD(ctx)
        a = v.shared_array(4096)
        mr = v.MR(pd, a.view(np.ndarray), v.IBV_ACCESS_LOCAL_WRITE)  # a plain view of it
        addr = int(a.ctypes.data)
        del a
        gc.collect()
        seg = _shm.locate(addr, 1)
        assert seg is not None and os.fstat(seg[0].fd).st_ino == seg[0].ino
        del seg
        mr.close()


def test_own_memory_of_an_mr_is_shared_and_published_with_its_keys() -> None:
    with v.Context(name="simib0") as ctx:
        pd = v.PD(ctx)
        own = v.MR(pd, 4096, v.IBV_ACCESS_LOCAL_WRITE | v.IBV_ACCESS_REMOTE_WRITE)
        private = v.MR(pd, bytearray(4096), v.IBV_ACCESS_LOCAL_WRITE)
        table = _hca.hca("simib0").table
        assert table is not None
        rows = {int(row[_shm.MR_KEY]) & 0xFFFFFFFF: row for row in table.mrs if row[_shm.MR_KEY]}
        assert own.rkey in rows and private.rkey not in rows
        row = rows[own.rkey]
        assert (row[_shm.MR_ADDR], row[_shm.MR_LENGTH]) == (own.buf, 4096)
        assert row[_shm.MR_ACCESS] == v.IBV_ACCESS_LOCAL_WRITE | v.IBV_ACCESS_REMOTE_WRITE
        own.close()
        assert own.rkey not in {int(r[_shm.MR_KEY]) & 0xFFFFFFFF for r in table.mrs if r[_shm.MR_KEY]}


def test_a_process_does_not_attach_to_its_own_table() -> None:
    with v.Context(name="simib0"):
        assert _shm.Peer.attach(os.getpid(), _hca.hca("simib0").endpoint) is None
