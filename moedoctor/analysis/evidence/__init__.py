"""The evidence the mechanisms and the patterns share: the run seen per rank (``view``), where a rank
is in its step and which loops ran (``steps``), the job's own source at a call site (``source``), the
frames of a stack (``stack_reading``) and the collectives' timing (``timing``), and the requirements
more than one pattern declares (``requirements``)."""
