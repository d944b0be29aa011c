"""The numba tier's kept launches (``launch.Launch``), without a GPU: what decides that an argument must be
converted again (``launch.argument_key``, ``arrays.tensor_key``), and a ``Launch`` driven through a stand-in
for Numba's dispatcher and cuda.core's launch.

The simulator never keeps a launch (every launch goes through Numba there), so these tests replace the
pieces a kept launch reads of Numba: a dispatcher that compiles an overload per tuple of argument types and
converts arguments as ``_Kernel._prepare_args`` does (size, itemsize, address, shape, strides for an array; a
scalar's bits), and the launcher (cuda.core's ``launch``, ``LaunchConfig``, the current context). The one
property every test checks: each launch either goes through the dispatcher, or is made with exactly the
arguments a fresh conversion of this launch's arguments gives. ``tests/test_numba_launch_gpu.py`` checks the
same against the real Numba, on a GPU.
"""

from __future__ import annotations

import ctypes
import struct
from types import SimpleNamespace

import numpy as np
import pytest

from bsrattn.numba_cuda import arrays, launch


class FakeDeviceArray:
    """What Numba's launch reads of a device array."""

    __cuda_ndarray__ = True

    def __init__(self, ptr=0x7F0000, shape=(4, 3), strides=None, dtype=np.float32, copied_back=False):
        self.copied_back = copied_back  # Numba's conversion leaves work for after the launch
        self.dtype = np.dtype(dtype)
        self.shape = tuple(shape)
        self.strides = tuple(strides) if strides is not None else (shape[1] * self.dtype.itemsize, self.dtype.itemsize)
        self.device_ctypes_pointer = ctypes.c_void_p(ptr)

    def replace(self, **fields):
        now = dict(ptr=self.device_ctypes_pointer.value, shape=self.shape, strides=self.strides, dtype=self.dtype,
                   copied_back=self.copied_back)
        return FakeDeviceArray(**{**now, **fields})


def numba_type(arg):
    """A stand-in for ``typeof``: an array's dtype, dimensions and layout; a scalar's Python type."""
    if isinstance(arg, FakeDeviceArray):
        c_order = arg.strides == (arg.shape[1] * arg.dtype.itemsize, arg.dtype.itemsize)
        return "array", arg.dtype, len(arg.shape), "C" if c_order else "A"
    return type(arg)


def convert(arg) -> list:
    """A stand-in for ``_Kernel._prepare_args``: what the launch receives for ``arg``."""
    if isinstance(arg, FakeDeviceArray):
        return [0, 0, int(np.prod(arg.shape)), arg.dtype.itemsize, arg.device_ctypes_pointer.value, *arg.shape,
                *arg.strides]
    if isinstance(arg, np.ndarray):
        return [0, 0, arg.size, arg.itemsize, id(arg), *arg.shape, *arg.strides]
    return [(type(arg), struct.pack("<d", arg) if isinstance(arg, (float, np.floating)) else arg)]


class FakeCompiled:
    """An overload: Numba's ``_Kernel`` as a kept launch reads it."""

    cooperative = False

    def __init__(self, types, debug=False):
        self.argument_types, self.debug, self.extensions = types, debug, []
        self.function = object()
        self._codelibrary = SimpleNamespace(get_cufunc=lambda: SimpleNamespace(kernel=self.function))
        self.conversions = 0

    def _prepare_args(self, ty, val, stream, retr, kernelargs):
        assert ty == numba_type(val) and stream == "numba's stream"
        self.conversions += 1
        if isinstance(val, np.ndarray) or getattr(val, "copied_back", False):  # a host array: copied back
            retr.append(lambda: None)
        kernelargs.extend(convert(val))


class FakeDispatcher:
    """``kernel[grid, threads](*args)``: compiles an overload per tuple of argument types and records the launch."""

    def __init__(self, log, debug=False):
        self.overloads, self.log, self.debug, self.fails = {}, log, debug, False

    def typeof_pyval(self, arg):
        return numba_type(arg)

    def __getitem__(self, config):
        grid, threads = config
        dispatcher = self

        class Configured:
            griddim, blockdim, sharedmem, stream, pre_launch_callbacks = grid, threads, 0, "numba's stream", []

            def __call__(self, *args):
                if dispatcher.fails:
                    raise RuntimeError("launch failed")
                types = tuple(map(numba_type, args))
                compiled = dispatcher.overloads.setdefault(types, FakeCompiled(types, dispatcher.debug))
                dispatcher.log.append(("numba", compiled.function, grid, [x for a in args for x in convert(a)]))

        return Configured()


@pytest.fixture
def world(monkeypatch):
    """A launcher whose launches are logged, in context 1."""
    log = []
    state = SimpleNamespace(log=log, context=1)

    def core_launch(stream, config, function, *arguments):
        assert stream == "numba's stream" and config["shmem_size"] == 0
        log.append(("kept", function, config["grid"], list(arguments)))

    monkeypatch.setattr(launch, "_LAUNCHER", SimpleNamespace(
        launch=core_launch, config=lambda **fields: fields, context=lambda: state.context))
    return state


def launched(world, kernel, grid, args, path):
    """Assert that the last launch went by ``path`` and was made with ``args`` freshly converted."""
    how, function, at, arguments = world.log[-1]
    assert how == path
    assert at == grid and arguments == [x for a in args for x in convert(a)]
    assert function is kernel.overloads[tuple(map(numba_type, args))].function


# ---- the keys ------------------------------------------------------------------------------------------------

ARRAY_CHANGES = {
    "address": dict(ptr=0x7F0100),
    "shape": dict(shape=(5, 3)),
    "strides": dict(strides=(20, 4)),
    "dtype": dict(dtype=np.int32),
}


@pytest.mark.parametrize("field", ARRAY_CHANGES)
def test_each_field_of_a_device_array_changes_its_key(field):
    a = FakeDeviceArray()
    assert launch.argument_key(a) == launch.argument_key(a.replace())  # another object, the same array
    assert launch.argument_key(a) != launch.argument_key(a.replace(**ARRAY_CHANGES[field]))


def test_a_scalars_key_is_its_type_and_bits():
    key = launch.argument_key
    assert key(16) == key(16) and key(16) != key(17)
    assert key(1) != key(True) and key(1) != key(np.int32(1)) and key(np.int32(1)) != key(np.int64(1))
    assert key(np.float32(0.5)) == key(np.float32(0.5)) != key(np.float32(0.25))
    assert key(np.float32(0.5)) != key(np.float64(0.5)) and key(0.5) != key(np.float64(0.5))
    assert key(0.0) != key(-0.0) and key(np.float32(0.0)) != key(np.float32(-0.0))


def test_kinds_never_kept_have_no_key():
    assert launch.argument_key(np.zeros(3)) is None  # a host array: Numba copies it for each launch
    assert launch.argument_key(SimpleNamespace(__cuda_array_interface__={})) is None
    assert launch.argument_key(1j) is None and launch.argument_key((1, 2)) is None


def test_each_field_of_a_tensor_changes_its_key():
    torch = pytest.importorskip("torch")
    x = torch.zeros(6, 4)
    key = arrays.tensor_key
    assert key(x) == key(x[:]) == key(x.view(6, 4))  # other tensor objects over the same memory
    assert key(x) != key(x[1:])                      # address (and shape)
    assert key(x[:, :2]) != key(x[:, 2:])            # address alone
    assert key(x[:, :2]) != key(x[:, :3])            # shape alone
    assert key(x) != key(x.as_strided((6, 4), (1, 6)))  # strides alone
    assert key(x) != key(x.view(torch.int32))        # dtype
    assert key(x) != key(x.detach().requires_grad_())
    y = torch.zeros(6, 4)
    before = key(y)
    y.set_(torch.zeros(6, 4))                        # the same object, other memory
    assert key(y) != before
    assert key(x.numpy()) is None and key(torch.nn.Parameter(x)) is None and key(None) is None


# ---- a Launch --------------------------------------------------------------------------------------------------

def test_a_launch_is_kept_after_numbas_and_follows_every_change(world):
    kernel = FakeDispatcher(world.log)
    run = launch.Launch()
    args = [FakeDeviceArray(strides=(16, 4)), FakeDeviceArray(ptr=0x900000), 16, np.float32(0.5)]

    def call(path, grid=(3, 2), kernel=kernel):
        run(kernel, grid, 128, *args)
        launched(world, kernel, grid, args, path)

    call("numba")
    call("kept")
    compiled = kernel.overloads[tuple(map(numba_type, args))]
    conversions = compiled.conversions
    args[1] = args[1].replace()  # a new object for the same array: nothing is converted again
    call("kept")
    assert compiled.conversions == conversions
    for field, change in ARRAY_CHANGES.items():
        if field != "dtype":  # the same Numba type (layout "A" throughout): that argument alone is converted again
            args[0] = args[0].replace(**change)
            call("kept")
            assert compiled.conversions == conversions + 1, field
            conversions += 1
    args[2], args[3] = 17, np.float32(-0.0)
    call("kept")
    args[3] = np.float32(0.0)
    call("kept")
    args[0] = args[0].replace(dtype=np.float64)  # another Numba type: another overload, through Numba
    call("numba")
    call("kept")
    args[0] = args[0].replace(strides=(24, 8))  # C-contiguous now: another layout, another overload
    call("numba")
    call("kept")
    args[2] = np.int32(17)
    call("numba")
    call("kept")
    call("numba", grid=(4, 2))
    call("kept", grid=(4, 2))
    world.context = 2
    call("numba", grid=(4, 2))
    call("kept", grid=(4, 2))
    other = FakeDispatcher(world.log)
    call("numba", kernel=other)
    call("kept", kernel=other)


def test_kinds_that_are_never_kept(world, monkeypatch):
    kernel = FakeDispatcher(world.log)
    run = launch.Launch()
    for args in ([FakeDeviceArray(), np.zeros(3)], [FakeDeviceArray(copied_back=True), 3]):
        for _ in range(2):
            run(kernel, (2, 1), 64, *args)
            launched(world, kernel, (2, 1), args, "numba")
    debug = FakeDispatcher(world.log, debug=True)
    plain = [FakeDeviceArray(), 3]
    for _ in range(2):
        run(debug, (2, 1), 64, *plain)
        launched(world, debug, (2, 1), plain, "numba")
    world.context = 0  # no current CUDA context: nothing to launch into without Numba
    for _ in range(2):
        run(kernel, (2, 1), 64, *plain)
        launched(world, kernel, (2, 1), plain, "numba")
    world.context = 1
    run(kernel, (2, 1), 64, *plain)
    run(kernel, (2, 1), 64, *plain)
    launched(world, kernel, (2, 1), plain, "kept")
    monkeypatch.setattr(launch, "KEEPS_LAUNCHES", False)
    run(kernel, (2, 1), 64, *plain)
    launched(world, kernel, (2, 1), plain, "numba")


def test_a_launch_that_fails_through_numba_keeps_nothing(world):
    kernel = FakeDispatcher(world.log)
    run = launch.Launch()
    args = [FakeDeviceArray(), 3]
    run(kernel, (2, 1), 64, *args)
    run(kernel, (2, 1), 64, *args)
    launched(world, kernel, (2, 1), args, "kept")
    kernel.fails = True
    args[0] = args[0].replace(dtype=np.float64)
    with pytest.raises(RuntimeError, match="launch failed"):
        run(kernel, (2, 1), 64, *args)
    assert run._kept is None
    kernel.fails = False
    run(kernel, (2, 1), 64, *args)
    launched(world, kernel, (2, 1), args, "numba")
