"""Headless EGL: a display on a GPU through EGL's device platform and an OpenGL core context on it, for the render
workloads (egl_render.py, the cloud-gaming player, the driving simulation) and the benchmarks that time a context's
start (bench/hook_startup.py).

EGL is driven through ctypes (libEGL.so.1, as glvnd provides it) so that the extension entry points
(eglQueryDevicesEXT, eglGetPlatformDisplayEXT) are loaded explicitly with eglGetProcAddress; GL calls go through
PyOpenGL with PYOPENGL_PLATFORM=egl.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# EGL constants (EGL 1.5 and EXT_device_* / EXT_platform_device).
EGL_SUCCESS = 0x3000
EGL_NONE = 0x3038
EGL_VENDOR = 0x3053
EGL_VERSION = 0x3054
EGL_EXTENSIONS = 0x3055
EGL_CLIENT_APIS = 0x308D
EGL_SURFACE_TYPE = 0x3033
EGL_PBUFFER_BIT = 0x0001
EGL_RENDERABLE_TYPE = 0x3040
EGL_OPENGL_BIT = 0x0008
EGL_RED_SIZE = 0x3024
EGL_GREEN_SIZE = 0x3023
EGL_BLUE_SIZE = 0x3022
EGL_ALPHA_SIZE = 0x3021
EGL_WIDTH = 0x3057
EGL_HEIGHT = 0x3056
EGL_OPENGL_API = 0x30A2
EGL_CONTEXT_MAJOR_VERSION = 0x3098
EGL_CONTEXT_MINOR_VERSION = 0x30FB
EGL_CONTEXT_OPENGL_PROFILE_MASK = 0x30FD
EGL_CONTEXT_OPENGL_CORE_PROFILE_BIT = 0x0001
EGL_PLATFORM_DEVICE_EXT = 0x313F
EGL_DRM_DEVICE_FILE_EXT = 0x3233
EGL_DEFAULT_DISPLAY = None
EGL_NO_CONTEXT = None
EGL_NO_SURFACE = None

EGL_ERRORS = {
    0x3000: "EGL_SUCCESS", 0x3001: "EGL_NOT_INITIALIZED", 0x3002: "EGL_BAD_ACCESS",
    0x3003: "EGL_BAD_ALLOC", 0x3004: "EGL_BAD_ATTRIBUTE", 0x3005: "EGL_BAD_CONFIG",
    0x3006: "EGL_BAD_CONTEXT", 0x3007: "EGL_BAD_CURRENT_SURFACE", 0x3008: "EGL_BAD_DISPLAY",
    0x3009: "EGL_BAD_MATCH", 0x300A: "EGL_BAD_NATIVE_PIXMAP", 0x300B: "EGL_BAD_NATIVE_WINDOW",
    0x300C: "EGL_BAD_PARAMETER", 0x300D: "EGL_BAD_SURFACE", 0x300E: "EGL_CONTEXT_LOST",
    0x322B: "EGL_BAD_DEVICE_EXT",
}

# OpenGL versions tried for the core context, newest first.
GL_VERSIONS = ((4, 6), (4, 5), (4, 3), (4, 1), (3, 3))


class EGLUnavailable(RuntimeError):
    """EGL or a usable OpenGL context could not be had; the message says which step failed."""


# --------------------------------------------------------------------------------------------- EGL


class Egl:
    """Thin ctypes binding of the few EGL calls used here (typed, so pointers are not truncated)."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libEGL.so.1")
        except OSError as exc:
            raise EGLUnavailable(
                f"cannot load libEGL.so.1 ({exc}); on the GPU machine source .devcache/setup.sh "
                "(it unpacks the glvnd EGL loader), elsewhere install libegl1") from exc
        vp, i32, u32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint32
        pi32 = ctypes.POINTER(i32)
        self._sig(lib, "eglGetProcAddress", vp, [ctypes.c_char_p])
        self._sig(lib, "eglGetError", i32, [])
        self._sig(lib, "eglGetDisplay", vp, [vp])
        self._sig(lib, "eglInitialize", u32, [vp, pi32, pi32])
        self._sig(lib, "eglTerminate", u32, [vp])
        self._sig(lib, "eglQueryString", ctypes.c_char_p, [vp, i32])
        self._sig(lib, "eglChooseConfig", u32, [vp, pi32, ctypes.POINTER(vp), i32, pi32])
        self._sig(lib, "eglBindAPI", u32, [u32])
        self._sig(lib, "eglCreateContext", vp, [vp, vp, vp, pi32])
        self._sig(lib, "eglDestroyContext", u32, [vp, vp])
        self._sig(lib, "eglCreatePbufferSurface", vp, [vp, vp, pi32])
        self._sig(lib, "eglDestroySurface", u32, [vp, vp])
        self._sig(lib, "eglMakeCurrent", u32, [vp, vp, vp, vp])
        self._sig(lib, "eglReleaseThread", u32, [])
        self.lib = lib
        self.query_devices = self._ext("eglQueryDevicesEXT", u32, [i32, ctypes.POINTER(vp), pi32])
        self.query_device_string = self._ext("eglQueryDeviceStringEXT", ctypes.c_char_p, [vp, i32])
        self.get_platform_display = self._ext("eglGetPlatformDisplayEXT", vp, [u32, vp, pi32])

    @staticmethod
    def _sig(lib: ctypes.CDLL, name: str, restype: Any, argtypes: list[Any]) -> None:
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes

    def _ext(self, name: str, restype: Any, argtypes: list[Any]) -> Callable[..., Any] | None:
        """Extension entry point via eglGetProcAddress, or None when the EGL lacks it."""
        addr = self.lib.eglGetProcAddress(name.encode())
        if not addr:
            return None
        return ctypes.CFUNCTYPE(restype, *argtypes)(addr)

    def error(self) -> str:
        code = int(self.lib.eglGetError())
        return EGL_ERRORS.get(code, hex(code))

    def query_string(self, dpy: int, name: int) -> str:
        raw = self.lib.eglQueryString(dpy, name)
        return raw.decode(errors="replace") if raw else ""


def attribs(*pairs: int) -> Any:
    """EGL attribute list: key, value, ..., EGL_NONE."""
    values = [*pairs, EGL_NONE]
    return (ctypes.c_int32 * len(values))(*values)


@dataclass
class Display:
    handle: int
    source: str  # how it was obtained, for the report


def _devices(egl: Egl) -> list[tuple[int, int, str]]:
    """(index, EGLDeviceEXT, device extensions) for every EGL device, software devices last."""
    if egl.query_devices is None:
        return []
    arr = (ctypes.c_void_p * 16)()
    count = ctypes.c_int32(0)
    if not egl.query_devices(16, arr, ctypes.byref(count)):
        return []
    found = []
    for i in range(count.value):
        dev = arr[i]
        if not dev:
            continue
        ext = b""
        if egl.query_device_string is not None:
            ext = egl.query_device_string(dev, EGL_EXTENSIONS) or b""
        found.append((i, dev, ext.decode(errors="replace")))
    # Prefer hardware: Mesa's software device (llvmpipe) must never stand in for the GPU silently.
    return sorted(found, key=lambda d: "EGL_MESA_device_software" in d[2])


def _initialize(egl: Egl, dpy: int | None) -> bool:
    if not dpy:
        return False
    major, minor = ctypes.c_int32(0), ctypes.c_int32(0)
    return bool(egl.lib.eglInitialize(dpy, ctypes.byref(major), ctypes.byref(minor)))


def open_display(egl: Egl, device_index: int | None) -> Display:
    """EGL display on a GPU device (EGL_PLATFORM_DEVICE_EXT); falls back to the default display."""
    tried: list[str] = []
    if egl.get_platform_display is not None:
        for index, dev, ext in _devices(egl):
            if device_index is not None and index != device_index:
                continue
            dpy = egl.get_platform_display(EGL_PLATFORM_DEVICE_EXT, dev, None)
            if _initialize(egl, dpy):
                soft = " (software)" if "EGL_MESA_device_software" in ext else ""
                return Display(dpy, f"EGL device {index}{soft}")
            tried.append(f"device {index}: {egl.error()}")
        if device_index is not None:
            raise EGLUnavailable(f"EGL device {device_index} unusable or absent ({tried or 'none listed'})")
    else:
        tried.append("EGL_EXT_platform_device/eglGetPlatformDisplayEXT not available")
    dpy = egl.lib.eglGetDisplay(EGL_DEFAULT_DISPLAY)
    if _initialize(egl, dpy):
        return Display(dpy, "eglGetDisplay(EGL_DEFAULT_DISPLAY)")
    tried.append(f"default display: {egl.error()}")
    raise EGLUnavailable(
        "no usable EGL display (" + "; ".join(tried) + "). Is the NVIDIA EGL vendor library "
        "registered? On the GPU machine `source .devcache/setup.sh` sets __EGL_VENDOR_LIBRARY_FILENAMES.")


def _choose_config(egl: Egl, dpy: int, pbuffer: bool) -> int | None:
    keys = [EGL_RENDERABLE_TYPE, EGL_OPENGL_BIT, EGL_RED_SIZE, 8, EGL_GREEN_SIZE, 8,
            EGL_BLUE_SIZE, 8, EGL_ALPHA_SIZE, 8]
    if pbuffer:
        keys += [EGL_SURFACE_TYPE, EGL_PBUFFER_BIT]
    config = ctypes.c_void_p()
    count = ctypes.c_int32(0)
    ok = egl.lib.eglChooseConfig(dpy, attribs(*keys), ctypes.byref(config), 1, ctypes.byref(count))
    return config.value if ok and count.value > 0 else None


@dataclass
class GLContext:
    egl: Egl
    display: Display
    context: int
    surface: int | None
    version: tuple[int, int]

    def close(self) -> None:
        lib, dpy = self.egl.lib, self.display.handle
        lib.eglMakeCurrent(dpy, EGL_NO_SURFACE, EGL_NO_SURFACE, EGL_NO_CONTEXT)
        if self.surface:
            lib.eglDestroySurface(dpy, self.surface)
        lib.eglDestroyContext(dpy, self.context)
        lib.eglTerminate(dpy)
        lib.eglReleaseThread()


def create_context(egl: Egl, display: Display) -> GLContext:
    """OpenGL 4.x (down to 3.3) core context, current on a tiny pbuffer (or surfaceless)."""
    dpy = display.handle
    config = _choose_config(egl, dpy, pbuffer=True)
    pbuffer = config is not None
    if config is None:  # some EGLs expose OpenGL configs without pbuffer support: go surfaceless
        config = _choose_config(egl, dpy, pbuffer=False)
    if config is None:
        raise EGLUnavailable(f"no EGL config with EGL_OPENGL_BIT and RGBA8 ({egl.error()}); "
                             f"client APIs: {egl.query_string(dpy, EGL_CLIENT_APIS)!r}")
    if not egl.lib.eglBindAPI(EGL_OPENGL_API):
        raise EGLUnavailable(f"eglBindAPI(EGL_OPENGL_API) failed ({egl.error()})")
    context, version, errors = None, (0, 0), []
    for major, minor in GL_VERSIONS:
        context = egl.lib.eglCreateContext(dpy, config, EGL_NO_CONTEXT, attribs(
            EGL_CONTEXT_MAJOR_VERSION, major, EGL_CONTEXT_MINOR_VERSION, minor,
            EGL_CONTEXT_OPENGL_PROFILE_MASK, EGL_CONTEXT_OPENGL_CORE_PROFILE_BIT))
        if context:
            version = (major, minor)
            break
        errors.append(f"{major}.{minor}: {egl.error()}")
    if not context:
        raise EGLUnavailable("eglCreateContext failed for every OpenGL core version (" +
                             "; ".join(errors) + ")")
    surface = None
    if pbuffer:
        surface = egl.lib.eglCreatePbufferSurface(dpy, config, attribs(EGL_WIDTH, 16, EGL_HEIGHT, 16))
    if not egl.lib.eglMakeCurrent(dpy, surface, surface, context):
        raise EGLUnavailable(f"eglMakeCurrent failed ({egl.error()})")
    return GLContext(egl, display, context, surface, version)


@contextmanager
def gl_context(device_index: int | None) -> Iterator[GLContext]:
    egl = Egl()
    ctx = create_context(egl, open_display(egl, device_index))
    try:
        yield ctx
    finally:
        ctx.close()
