"""Reading a run: run directories, trace folders and Flight Recorder dumps, parsed at the boundary
into ``RunData`` (``run_data``) by ``load`` (whole files) or ``scan`` (windows of large ones)."""
