"""Process management: several workers behind one port and their supervisor."""
