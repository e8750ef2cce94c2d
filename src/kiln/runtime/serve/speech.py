"""A speech program served as OpenAI's transcription route (POST /v1/audio/transcriptions, a multipart upload).

The uploaded WAV is decoded in memory (kiln.runtime.audio) and transcribed on a worker thread, one request at a
time per session (a lock); `response_format` json, text or verbose_json as OpenAI defines them.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from kiln.runtime.audio.wav import AudioFormatError, load_audio
from kiln.runtime.program import Program
from kiln.runtime.serve.metrics import Metrics
from kiln.runtime.serve.protocol import APIError, bad_field
from kiln.runtime.serve.service import ServeOptions, Service
from kiln.runtime.speech import transcriber
from kiln.runtime.speech.transcript import Transcript

MAX_UPLOAD_BYTES = 100 * 1024 * 1024
FORMATS = ("json", "text", "verbose_json")


class SpeechService(Service):
    kind = "speech"

    def __init__(self, program: Program, backend: str, model_id: str, metrics: Metrics, options: ServeOptions):
        super().__init__(model_id, metrics)
        self.transcriber = transcriber(program, backend)
        self._lock = threading.Lock()

    def routes(self) -> list[Route]:
        return [Route("/v1/audio/transcriptions", self.transcriptions, methods=["POST"])]

    async def transcriptions(self, request: Request) -> Response:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise APIError(400, "send the audio as multipart/form-data with a 'file' field", param="file")
        try:
            async with request.form(max_files=1, max_fields=16) as form:
                fmt, data = await self._fields(form)
        except APIError:
            raise
        except Exception as e:  # a malformed multipart body
            raise APIError(400, f"the multipart body cannot be read: {e}", param="file") from None
        transcript = await asyncio.to_thread(self._transcribe, data)
        self.metrics.count("kiln_audio_seconds_total", "seconds of audio transcribed", transcript.audio_seconds)
        if fmt == "text":
            return PlainTextResponse(transcript.text + "\n")
        if fmt == "verbose_json":
            return JSONResponse({"task": "transcribe", "duration": transcript.audio_seconds, "text": transcript.text,
                                 "segments": [{"id": k, "text": t} for k, t in enumerate(transcript.windows)]})
        return JSONResponse({"text": transcript.text})

    async def _fields(self, form: Any) -> tuple[str, bytes]:
        """(response_format, the file's bytes) of the upload, its model checked."""
        self.check_model(form.get("model"))
        fmt = form.get("response_format") or "json"
        if fmt not in FORMATS:
            raise bad_field("response_format", f"'response_format' must be one of {list(FORMATS)}",
                            code="invalid_value")
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise bad_field("file", "'file' is a required multipart file field", code="missing_required_parameter")
        data = await upload.read(MAX_UPLOAD_BYTES + 1)
        if len(data) > MAX_UPLOAD_BYTES:
            raise bad_field("file", f"the file is larger than {MAX_UPLOAD_BYTES // 2**20} MiB", code="invalid_value")
        return fmt, data

    def _transcribe(self, data: bytes) -> Transcript:
        try:
            samples = load_audio(data)
        except AudioFormatError as e:
            raise bad_field("file", f"the file is not audio kiln can read: {e}", code="invalid_value") from None
        if samples.size == 0:
            raise bad_field("file", "the audio is empty", code="invalid_value")
        with self._lock:
            return self.transcriber.transcribe(samples)


__all__ = ["SpeechService"]
