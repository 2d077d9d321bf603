"""Output files from decoded frames: MP4 for video, PNG for one frame, and raw ``.npy``.

Frames arrive in chunks and MP4 frames go to the encoder as they come, so a long video is never
held whole in memory. ``.npy`` (uint8, loadable with ``allow_pickle=False``) is the lossless
form used for verification and downstream processing.
"""

from __future__ import annotations

import io
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from keys import OutputFormat


def encode_frames(chunks: Iterable[np.ndarray], fmt: OutputFormat, fps: int) -> bytes:
    """Bytes of the output file for uint8 frames (F, H, W, 3), given chunk by chunk."""
    if fmt is OutputFormat.MP4:
        return _mp4(chunks, fps)
    frames = np.concatenate(list(chunks))
    if fmt is OutputFormat.NPY:
        buf = io.BytesIO()
        np.save(buf, frames, allow_pickle=False)
        return buf.getvalue()
    import imageio.v3 as iio

    if frames.shape[0] != 1:
        raise ValueError(f"png output needs num_frames=1, got {frames.shape[0]} frames")
    return bytes(iio.imwrite("<bytes>", frames[0], extension=".png"))


def _mp4(chunks: Iterable[np.ndarray], fps: int) -> bytes:
    import imageio_ffmpeg

    with tempfile.TemporaryDirectory(prefix="diffcache-mp4-") as tmp:
        path = Path(tmp) / "out.mp4"
        writer = None
        for chunk in chunks:
            for frame in chunk:
                if writer is None:
                    height, width = frame.shape[:2]
                    writer = imageio_ffmpeg.write_frames(
                        str(path), (width, height), fps=fps, codec="libx264",
                        pix_fmt_out="yuv420p", macro_block_size=1,
                        output_params=["-movflags", "+faststart"])
                    writer.send(None)
                writer.send(np.ascontiguousarray(frame))
        if writer is None:
            raise ValueError("no frames to encode")
        writer.close()
        return path.read_bytes()


def decode_npy(data: bytes) -> np.ndarray:
    """The frames of an ``.npy`` output; refuses pickled object arrays."""
    frames: np.ndarray = np.load(io.BytesIO(data), allow_pickle=False)
    return frames
