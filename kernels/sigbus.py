"""A SIGBUS handler, compiled: one line on stderr and exit 1, for a mapped model file cut short
while in use. The weights of a GGUF or safetensors file are read where the file is mapped; a
file truncated (or rewritten) under a running tinyrt makes the next read of a lost page a bus
error, which would otherwise kill the process with no word of why. Python cannot catch it (its
handler returns and the read faults again): this is a C function, whose only calls are
async-signal-safe (write, _exit); compiled by Numba with its message as a constant, so that it
is cached like every kernel."""

from __future__ import annotations

import signal

from llvmlite import ir
from numba import cfunc, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from . import jit_cache

jit_cache.guard()

MESSAGE = (b"tinyrt: error: a model file was cut short or changed while tinyrt was reading it "
           b"(a bus error reading its weights): load the model again\n")
EXIT = 1


@intrinsic
def _write_and_exit(typingctx, status):
    """write(2, MESSAGE), then _exit(status): libc's, declared in the module and linked as
    Numba links its own C helpers."""
    def codegen(context, builder, signature, args):
        module = builder.module
        size_t = context.get_value_type(types.intp)
        i32 = ir.IntType(32)
        write = cgutils.get_or_insert_function(
            module, ir.FunctionType(size_t, [i32, ir.IntType(8).as_pointer(), size_t]), "write")
        exit_ = cgutils.get_or_insert_function(module, ir.FunctionType(ir.VoidType(), [i32]),
                                               "_exit")
        text = context.insert_const_bytes(module, MESSAGE)
        builder.call(write, [ir.Constant(i32, 2), text, ir.Constant(size_t, len(MESSAGE))])
        builder.call(exit_, [args[0]])
        return context.get_dummy_value()

    return types.void(types.int32), codegen


@cfunc(types.void(types.int32), cache=True)
def _on_sigbus(signum):
    _write_and_exit(signum - signum + EXIT)


_installed = False


def install() -> None:
    """Make a bus error end the process with MESSAGE (once per process; where the system has
    SIGBUS and a C library to set the handler with)."""
    global _installed
    if _installed or not hasattr(signal, "SIGBUS"):
        return
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        libc.signal.argtypes, libc.signal.restype = [ctypes.c_int, ctypes.c_void_p], \
            ctypes.c_void_p
    except (OSError, AttributeError):
        return
    libc.signal(signal.SIGBUS, _on_sigbus.address)
    _installed = True
