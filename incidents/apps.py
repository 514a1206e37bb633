"""App config for incidents: at app ready it installs its recorders into kvserve's hook point
(kvserve/incident_hooks.py), through which the chat services and the engine's callbacks report incidents."""
from django.apps import AppConfig

from kvserve.incident_hooks import incident_hooks_install


class IncidentsConfig(AppConfig):
    name = "incidents"
    verbose_name = "Incidents and canaries"

    def ready(self) -> None:
        from incidents.services import incident_record, probe_record  # models: importable once apps are ready

        incident_hooks_install(incident_record=incident_record, probe_record=probe_record)
