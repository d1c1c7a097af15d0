"""Where derived records and engine steps are kept: the SQLite store, the child process that
writes it, and the durable mode's write-ahead spool. Imports the pipeline's record types only."""
