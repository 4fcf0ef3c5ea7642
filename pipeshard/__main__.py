from pipeshard.cli import entry

entry()
