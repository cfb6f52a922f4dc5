"""Starting servers as real processes: spawn, supervise, serve one process or several, lifelines."""
