from lorasync.cli import entry

entry()
