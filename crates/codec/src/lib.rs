//! Page codecs.
