// The translation unit that builds the shared precompiled header (pch.h); it holds no code.
