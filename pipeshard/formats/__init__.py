"""The files between the stages as typed records: export.json, the pack manifest, plans.json, the profile DB and
the graph IO names the runtime binds. Every stage imports these; they import only `pipeshard.core`."""
