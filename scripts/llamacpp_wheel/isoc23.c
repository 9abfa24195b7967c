/* glibc 2.38's C23 names for strtol & co, mapped to the older ones (they differ only in
   accepting a 0b prefix), so a wheel built against glibc 2.38 loads on Debian 12's 2.36. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
long __isoc23_strtol(const char *s, char **e, int b) { return strtol(s, e, b); }
unsigned long __isoc23_strtoul(const char *s, char **e, int b) { return strtoul(s, e, b); }
unsigned long long __isoc23_strtoull(const char *s, char **e, int b) { return strtoull(s, e, b); }
long long __isoc23_strtoll(const char *s, char **e, int b) { return strtoll(s, e, b); }
int __isoc23_sscanf(const char *s, const char *f, ...) {
    va_list ap; va_start(ap, f); int n = vsscanf(s, f, ap); va_end(ap); return n;
}
