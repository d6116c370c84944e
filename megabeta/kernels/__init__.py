"""Fused CPU kernels, compiled from C++ on first use (torch's extension loader), with the
plain-torch path as the fallback wherever they cannot be built."""
