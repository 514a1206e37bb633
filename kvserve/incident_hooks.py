"""The hook point through which kvserve reports what the incidents app records: an incident (the one way is
incidents.services.incident_record) and a live probe's finding (incidents.services.probe_record). The incidents
app installs both when Django is ready (incidents/apps.py), so kvserve never imports incidents; reporting in a
process where they were never installed raises, naming the missing hook."""
_hooks: dict = {}


def incident_hooks_install(*, incident_record, probe_record) -> None:
    """Installs the recorders (incidents/apps.py, at app ready); a second install replaces the first."""
    _hooks.update(incident_record=incident_record, probe_record=probe_record)


def _hook(name: str):
    try:
        return _hooks[name]
    except KeyError:
        raise RuntimeError(f"no {name} hook is installed: the incidents app installs it when Django is ready "
                           f"(is `incidents` in INSTALLED_APPS?)") from None


def incident_report(**fields):
    """Records an incident (incidents.services.incident_record's keyword arguments); the Incident."""
    return _hook("incident_record")(**fields)


def probe_report(probe_id: str, record: dict) -> None:
    """Stores what a live probe found, for the canary that sent it (incidents.services.probe_record)."""
    _hook("probe_record")(probe_id, record)
