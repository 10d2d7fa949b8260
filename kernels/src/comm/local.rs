//! N ranks as threads of one process (to be implemented).
