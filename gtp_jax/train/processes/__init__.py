"""Runs of several processes: joining one (`distributed`) and starting one on this host
(`launch`)."""
