"""Thin Celery tasks: each takes a request id (and the payload the next stage needs) and calls a service.
They are sent by name (kvserve/dispatch.py), never imported by their senders."""
from celery import shared_task

from kvserve.chat import reaper, services
from kvserve.dispatch import DECODE, PREFILL, REAP


@shared_task(name=PREFILL, ignore_result=True)
def prefill(request_id: str, prompt_ids: list[int]) -> None:
    services.chat_request_prefill(request_id, prompt_ids)


@shared_task(name=DECODE, ignore_result=True)
def decode(request_id: str, prompt_ids: list[int], handoff: dict) -> None:
    services.chat_request_decode(request_id, prompt_ids, handoff)


@shared_task(name=REAP, ignore_result=True)
def reap() -> dict:
    return reaper.requests_reap_orphans()
